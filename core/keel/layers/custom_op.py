"""Custom ops: fused kernels that plugins register for the math of core layers (elementwise ops, MoE).

A layer class names the ops it can delegate in `custom_ops` (e.g. `RMSNorm.custom_ops =
("rms_norm", "fused_add_rms_norm")`) and reads its instance's `bound_ops` mapping in `forward`, falling
back to its native torch math for an op that is not bound. Plugins register providers under the
`custom_op` registry kind, keyed by op name. After the model is built and loaded -- and only when the
platform's `use_custom_ops()` says so -- the worker calls `bind_custom_ops`, which resolves each op
named by the model's layers to its provider (if that provider supports the device and dtype) and binds
it into those layer instances. A provider may also define `supports_layer(layer) -> bool` to decline
single layer instances (e.g. a routing configuration its kernel does not implement); those keep their
native math for that op, logged. Nothing is module-global: an unbound model is untouched.

A platform names the ops whose native math it cannot serve in `required_custom_ops()` (CUDA: the torch
MoE experts path reads which experts have work back to the host in every layer, so it cannot be captured
in a CUDA graph). A layer declaring such an op that ends up without a provider stops startup with a
`MissingCustomOpError` that names the op, the layers and why nothing was bound -- never a silent fallback.

Op contracts (every op but apply_token_bitmask returns new tensors and leaves its inputs unchanged, like
the native layers):

    rms_norm(x, weight, eps) -> out
        x: [..., hidden]; weight: [hidden]; out like `weight * norm(x).to(x.dtype)`.
    fused_add_rms_norm(x, residual, weight, eps) -> (out, new_residual)
        new_residual = x + residual (in the input dtype); out = rms_norm(new_residual, weight, eps).
    rotary_embedding(positions, q, k, cos_cache, sin_cache, head_size, rotary_dim) -> (q_out, k_out)
        neox rope on the first rotary_dim dims of each head; positions: [n] int; q: [n, heads * head_size];
        k: [n, kv_heads * head_size]; cos/sin_cache: [cache_len, rotary_dim] float32 (halves repeated).
    mla_rope(positions, q, k_pe, cos_cache, sin_cache, nope_dim, interleaved) -> (q_pe, k_pe_out)
        MLA's rope (`MLAAttention.rope`): q [n, heads, nope_dim + R] (the q projection's output, any
        strides with a contiguous last dim); k_pe [n, R] (any row stride). The rope part of each head,
        q[..., nope_dim:], and k_pe are de-interleaved (evens, then odds) when `interleaved`, then neox-
        rotated over all R dims; q_pe [n, heads, R] and k_pe_out [n, R] are new contiguous tensors; q's
        nope part is neither read nor copied. cos/sin_cache: [cache_len, R] float32 (halves repeated).
    mla_rope_norm(positions, q, k_pe, kv_c, kv_weight, eps, cos_cache, sin_cache, nope_dim, interleaved)
        -> (q_pe, k_pe_out, kv_c_out)
        mla_rope's outputs and kv_c_out = rms_norm(kv_c, kv_weight, eps) (MLA's kv_a_layernorm) in one call;
        kv_c: [n, L] (any row stride), kv_weight: [L] in kv_c's dtype; kv_c_out a new contiguous tensor.
    silu_and_mul(x) -> out
        x: [..., 2 * d]; out: [..., d] = silu(x[..., :d]) * x[..., d:].
    linear_small_m(x, weight, bias) -> out
        An unquantized linear layer (`LinearBase`, no quantization method): x [..., K]; weight [N, K];
        bias [N] or None; out [..., N] = F.linear(x, weight, bias) within the dtype's rounding (float32
        sums, any order). Providers decline layers (`supports_layer`) whose shape they have no measured
        reason to take, and may fall back to F.linear by row count (static per CUDA graph bucket).
    router_gemm(x, weight) -> router_logits
        A MoE router gate (e.g. DeepSeek's `MoEGate`): x [n, H] any float; weight [E, H] float32; logits
        [n, E] float32 = `F.linear(x.float(), weight)` with float32 products and sums (no TF32), in any
        summation order. No host sync.
    select_experts(router_logits, routing, e_score_correction_bias) -> (topk_weights, topk_ids)
        `keel.layers.fused_moe.router.select_experts`: router_logits [n, E] float; routing a RoutingConfig;
        bias [E] or None; weights [n, R] float32, ids [n, R] int32 or int64 with R = routing.num_routes
        (top_k, then the fused shared experts: ids E .. E + S - 1, weight 1.0). Exactly tied scores
        may pick another (equally valid) expert. Must not sync the host (decode steps are graph-captured).
    fused_experts(hidden, w13, w2, topk_weights, topk_ids, activation, residual) -> out
        `keel.layers.fused_moe.torch_ref.fused_experts_torch` (+ residual when not None): hidden [n, H];
        w13 [E, 2 * I, H] (gate rows, then up rows); w2 [E, H, I]; weights/ids from select_experts;
        activation a `get_act_and_mul_fn` name; residual [n, H] or None; out [n, H] in hidden's dtype.
        No host sync; launch shapes may depend on n only, never on the routing (graph replays).
        Quantized experts add an eighth argument, `quant` (a `FusedMoEQuantConfig`: w13 / w2 are then
        the quantized tensors it describes); a provider that does not implement its kind declines such
        layers in `supports_layer`, so they are never called with it.
    apply_token_bitmask(logits, bitmask, rows) -> logits
        `keel.layers.token_bitmask.apply_token_bitmask`, in place: logits [S, vocab] float; bitmask [R, W]
        int32 (bit t % 32 of word t // 32: token t allowed; W * 32 >= vocab); rows [R] int64, distinct:
        bitmask row i constrains logits row rows[i], whose disallowed tokens become -inf. Other entries
        are left as they are. No host sync (it runs in every constrained step, before sampling).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any, Protocol, runtime_checkable

import torch

logger = logging.getLogger("keel.custom_op")

CUSTOM_OP_NAMES: tuple[str, ...] = (
    "fused_add_rms_norm", "rms_norm", "rotary_embedding", "mla_rope", "mla_rope_norm", "silu_and_mul",
    "linear_small_m", "router_gemm", "select_experts", "fused_experts", "apply_token_bitmask",
)


@runtime_checkable
class CustomOpProvider(Protocol):
    """A registered `custom_op` entry (a class; the worker instantiates it with no arguments).

    `supports` is called once per op at bind time, after the model is loaded; `__call__` is called by
    the bound layers on every forward (also inside captured CUDA graphs), with the op's contract as in
    this module's docstring, and must match the layer's native math within the dtype's rounding.
    """

    def supports(self, device_type: str, dtype: torch.dtype) -> bool: ...

    def __call__(self, *args: Any) -> Any: ...


class CustomOpError(TypeError):
    """A registered custom op provider does not implement the provider protocol."""


class MissingCustomOpError(RuntimeError):
    """An op the platform requires (`Platform.required_custom_ops`) is declared by layers of the model but
    has no bound provider; the message names the op, the layers, the reason and the fix."""


def _resolve(registry: Any, name: str, device_type: str, dtype: torch.dtype) -> tuple[Any, str]:
    """(provider or None, why there is none)."""
    if name not in registry:
        return None, f"no loaded plugin provides it (custom ops registered: {sorted(registry)})"
    entry = registry.get(name)
    provider = entry() if isinstance(entry, type) else entry
    if not isinstance(provider, CustomOpProvider):
        raise CustomOpError(
            f"custom_op {name!r} from {registry.provider(name)} must have supports(device_type, dtype) and "
            f"be callable; got {type(provider).__name__}"
        )
    if not provider.supports(device_type, dtype):
        why = f"its provider ({registry.provider(name)}) does not support {device_type}/{dtype}"
        logger.info("custom op %r: %s; layers keep their native math", name, why)
        return None, why
    return provider, ""


def bind_custom_ops(
    model: torch.nn.Module,
    registry: Any,
    device_type: str,
    dtype: torch.dtype,
    required: Collection[str] = (),
) -> dict[str, int]:
    """Bind registered providers into every layer of `model` that declares `custom_ops`.

    Called by the worker once after loading, when `platform.use_custom_ops()`; `required` is the
    platform's `required_custom_ops()`. `registry` is the `custom_op` registry. Returns op name -> number
    of layer instances it was bound into (ops with no supporting provider are absent). A provider is
    resolved at most once per op name. Raises MissingCustomOpError if a required op stays unbound in a
    layer that declares it.
    """
    resolved: dict[str, tuple[Any, str]] = {}
    counts: dict[str, int] = {}
    missing: dict[str, list[tuple[str, str]]] = {}  # op -> (layer, reason)
    declined: dict[str, list[str]] = {}  # op -> layers its provider declined (logged once per op, below)
    for qualname, module in model.named_modules():
        names = getattr(type(module), "custom_ops", ())
        if not names:
            continue
        bound = dict(getattr(module, "bound_ops", {}))
        for name in names:
            if name not in resolved:
                resolved[name] = _resolve(registry, name, device_type, dtype)
            op, why = resolved[name]
            if op is not None and not _accepts(op, module):
                op, why = None, f"its provider ({registry.provider(name)}) declines this layer ({module!r})"
                declined.setdefault(name, []).append(qualname or "the model")
            if op is not None:
                bound[name] = op
                counts[name] = counts.get(name, 0) + 1
            elif name in required:
                missing.setdefault(name, []).append((qualname or type(module).__name__, why))
        if bound:
            module.bound_ops = bound
    for name, layers in declined.items():  # one line per op: a provider may decline most linear layers
        more = f" and {len(layers) - 3} more" if len(layers) > 3 else ""
        logger.info("custom op %r declined %s%s; they keep their native math", name, ", ".join(layers[:3]), more)
    if counts:
        logger.info("custom ops bound (%s, %s): %s", device_type, dtype,
                    ", ".join(f"{n} -> {registry.provider(n)} x{c}" for n, c in sorted(counts.items())))
    else:
        logger.info("no custom ops bound (%s, %s): registered %s", device_type, dtype, list(registry))
    if missing:
        raise MissingCustomOpError(_missing_message(missing, device_type))
    return counts


def _accepts(provider: Any, layer: torch.nn.Module) -> bool:
    check = getattr(provider, "supports_layer", None)
    return check is None or bool(check(layer))


def _missing_message(missing: dict[str, list[tuple[str, str]]], where: str) -> str:
    parts = []
    for name, rows in sorted(missing.items()):
        layers = ", ".join(q for q, _ in rows[:3]) + (f" and {len(rows) - 3} more" if len(rows) > 3 else "")
        parts.append(f"custom op {name!r} is required on {where} but not bound in {len(rows)} layer(s) "
                     f"({layers}): {rows[0][1]}")
    return ("; ".join(parts) + ". Add a plugin that provides these custom ops for this device and dtype to the "
            "profile's plugins (kernels-triton provides them for CUDA).")
