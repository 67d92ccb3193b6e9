"""The `custom_op` providers of kernels-triton: launch wrappers with keel's op contracts.

Registered by the `kernels-triton` manifest; the worker instantiates each class once and binds the
instance into the layers that declare the op (see `keel.layers.custom_op` for the contracts). Every op
allocates its outputs and leaves its inputs untouched, like the native layers. On CUDA the kernels are
compiled; on the CPU they run only through Triton's interpreter (`TRITON_INTERPRET=1`, tests).
"""

from __future__ import annotations

import torch
import triton

from keel_kernels_triton.kernels import mla_rope_kernel, rms_norm_kernel, rotary_kernel, silu_and_mul_kernel
from keel_kernels_triton.linear_small_m import linear_small_m, load_plans
from keel_kernels_triton.pdl import pdl_kwargs as _pdl
from keel_kernels_triton.support import SUPPORTED_DTYPES, TritonOp

# Widest row one program keeps in registers; wider rows take the two-sweep path.
MAX_NORM_BLOCK = 8192
SILU_BLOCK = 1024


class UnsupportedTensorError(ValueError):
    """An op got a tensor it cannot handle (dtype, shape); the message says what was expected."""


def _rows(x: torch.Tensor, width: int, what: str) -> torch.Tensor:
    """`x` as [rows, width] with a contiguous last dim, copying only when a view cannot do it."""
    if x.dtype not in SUPPORTED_DTYPES:
        raise UnsupportedTensorError(f"{what}: dtype {x.dtype} is not one of {SUPPORTED_DTYPES}")
    if x.shape[-1] != width:
        raise UnsupportedTensorError(f"{what}: last dim {x.shape[-1]} != {width}")
    x2 = x.reshape(-1, width)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm_launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = weight.shape[0]
    x2 = _rows(x, hidden, "rms_norm input")
    res_dtype = x.dtype
    if residual is not None:
        r2 = _rows(residual, hidden, "rms_norm residual")
        if r2.shape[0] != x2.shape[0]:
            raise UnsupportedTensorError(f"residual has {r2.shape[0]} rows, input {x2.shape[0]}")
        res_dtype = torch.promote_types(x.dtype, residual.dtype)
        res_out = torch.empty(x2.shape, dtype=res_dtype, device=x.device)
    else:
        r2 = res_out = x2  # unused by the kernel
    # As in torch, `weight * normalized` promotes (a float32 weight on bf16 activations gives float32).
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, res_dtype), device=x.device)
    rows = x2.shape[0]
    if rows:
        block = min(triton.next_power_of_2(hidden), MAX_NORM_BLOCK)
        rms_norm_kernel[(rows,)](
            x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            hidden, float(eps), HAS_RESIDUAL=residual is not None, BLOCK=block, SINGLE=block >= hidden,
            num_warps=min(max(block // 256, 1), 16), **_pdl(x),
        )
    shape = (*x.shape[:-1], hidden)
    return out.view(shape), (res_out.view(shape) if residual is not None else None)


class TritonRMSNorm(TritonOp):
    """`rms_norm(x, weight, eps) -> out`; x: [..., hidden], weight: [hidden]."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _norm_launch(x, None, weight, eps)[0]


class TritonFusedAddRMSNorm(TritonOp):
    """`fused_add_rms_norm(x, residual, weight, eps) -> (out, new_residual)` in one pass over the row."""

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        out, res = _norm_launch(x, residual, weight, eps)
        assert res is not None
        return out, res


class TritonRotaryEmbedding(TritonOp):
    """`rotary_embedding(positions, q, k, cos_cache, sin_cache, head_size, rotary_dim) -> (q, k)`.

    Neox layout; one launch rotates q and k; cos/sin are gathered by position inside the kernel.
    """

    def __call__(
        self,
        positions: torch.Tensor,  # [num_tokens] int
        q: torch.Tensor,  # [num_tokens, num_heads * head_size]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
        cos_cache: torch.Tensor,  # [cache_len, rotary_dim] float32
        sin_cache: torch.Tensor,  # [cache_len, rotary_dim] float32
        head_size: int,
        rotary_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = q.shape[0]
        q2, k2 = q.reshape(n, -1), k.reshape(n, -1)
        for name, t in (("q", q2), ("k", k2)):
            if t.shape[1] % head_size:
                raise UnsupportedTensorError(f"rope {name}: width {t.shape[1]} is not a multiple of {head_size}")
        q2 = _rows(q2, q2.shape[1], "rope q")
        k2 = _rows(k2, k2.shape[1], "rope k")
        if cos_cache.dtype != torch.float32 or not cos_cache.is_contiguous() or not sin_cache.is_contiguous():
            raise UnsupportedTensorError("rope caches must be contiguous float32 [cache_len, rotary_dim]")
        q_out, k_out = torch.empty_like(q2), torch.empty_like(k2)
        if n:
            nq, nk = q2.shape[1] // head_size, k2.shape[1] // head_size
            half = rotary_dim // 2
            block_half = triton.next_power_of_2(half)
            block_h = min(triton.next_power_of_2(max(nq, nk)), max(1, 4096 // block_half))
            rotary_kernel[(n, 2)](
                positions, q2, k2, q_out, k_out, cos_cache, sin_cache,
                q2.stride(0), k2.stride(0), q_out.stride(0), k_out.stride(0), nq, nk,
                HEAD=head_size, ROT=rotary_dim, HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half,
                BLOCK_PASS=triton.next_power_of_2(max(head_size - rotary_dim, 1)), **_pdl(q2),
                # no multiply-add contraction: torch rounds each product before the sum (fused, the compiler
                # emits a bf16 fma.rn for x * cos - round(x2 * sin); in float32 an FMA skips a rounding too)
                enable_fp_fusion=False,
            )
        return q_out, k_out


class TritonMLARope(TritonOp):
    """`mla_rope(positions, q, k_pe, cos_cache, sin_cache, nope_dim, interleaved) -> (q_pe, k_pe)`.

    One launch for MLA's q and k rope: q's rope parts are read where the q projection wrote them, so the
    layer hands q_nope to the attention as a view and nothing is concatenated or copied.
    """

    def __call__(
        self,
        positions: torch.Tensor,  # [n] int
        q: torch.Tensor,  # [n, heads, nope_dim + R], last dim contiguous
        k_pe: torch.Tensor,  # [n, R], last dim contiguous
        cos_cache: torch.Tensor,  # [cache_len, R] float32
        sin_cache: torch.Tensor,  # [cache_len, R] float32
        nope_dim: int,
        interleaved: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # q_pe [n, heads, R], k_pe [n, R], contiguous
        q_out, k_out, _ = _mla_rope(positions, q, k_pe, cos_cache, sin_cache, nope_dim, interleaved, None)
        return q_out, k_out


class TritonMLARopeNorm(TritonOp):
    """`mla_rope_norm(positions, q, k_pe, kv_c, kv_weight, eps, cos_cache, sin_cache, nope_dim, interleaved)
    -> (q_pe, k_pe, kv_c_out)`: `mla_rope` and the latent's RMSNorm (`rms_norm(kv_c, kv_weight, eps)`) in the
    same launch, a third program per token; the norm's arithmetic and reduction layout are rms_norm's."""

    def __call__(
        self,
        positions: torch.Tensor,  # [n] int
        q: torch.Tensor,  # [n, heads, nope_dim + R], last dim contiguous
        k_pe: torch.Tensor,  # [n, R], last dim contiguous
        kv_c: torch.Tensor,  # [n, L], last dim contiguous: the raw latent
        kv_weight: torch.Tensor,  # [L], kv_c's dtype
        eps: float,
        cos_cache: torch.Tensor,  # [cache_len, R] float32
        sin_cache: torch.Tensor,  # [cache_len, R] float32
        nope_dim: int,
        interleaved: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q_pe, k_pe, kv_c_out [n, L]: contiguous
        lora = kv_weight.shape[0]
        if kv_c.shape != (q.shape[0], lora) or kv_c.stride(-1) != 1 or kv_weight.dim() != 1:
            raise UnsupportedTensorError(f"mla_rope_norm: kv_c {tuple(kv_c.shape)} must be [n, {lora}] with a "
                                         f"contiguous last dim, kv_weight 1-d")
        if kv_c.dtype != kv_weight.dtype or kv_c.dtype not in SUPPORTED_DTYPES or lora > MAX_NORM_BLOCK:
            raise UnsupportedTensorError(f"mla_rope_norm: kv_c {kv_c.dtype} and its weight {kv_weight.dtype} "
                                         f"must share one of {SUPPORTED_DTYPES}, at most {MAX_NORM_BLOCK} wide")
        return _mla_rope(positions, q, k_pe, cos_cache, sin_cache, nope_dim, interleaved, (kv_c, kv_weight, eps))


def _mla_rope(
    positions: torch.Tensor, q: torch.Tensor, k_pe: torch.Tensor, cos_cache: torch.Tensor,
    sin_cache: torch.Tensor, nope_dim: int, interleaved: bool,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None,  # (kv_c [n, L], weight [L], eps), checked
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    n, heads, rot = q.shape[0], q.shape[1], k_pe.shape[-1]
    if q.dim() != 3 or q.shape[2] != nope_dim + rot or rot % 2 or k_pe.shape != (n, rot):
        raise UnsupportedTensorError(f"mla_rope: q {tuple(q.shape)} must be [n, heads, {nope_dim} + R], "
                                     f"k_pe {tuple(k_pe.shape)} [n, R] with R even")
    for name, t in (("q", q), ("k_pe", k_pe)):
        if t.dtype not in SUPPORTED_DTYPES or t.stride(-1) != 1:
            raise UnsupportedTensorError(f"mla_rope {name}: needs one of {SUPPORTED_DTYPES} with a "
                                         f"contiguous last dim, got {t.dtype} strides {t.stride()}")
    caches_ok = cos_cache.dtype == torch.float32 and cos_cache.shape[-1] == rot
    if not (caches_ok and cos_cache.is_contiguous() and sin_cache.is_contiguous()):
        raise UnsupportedTensorError(f"mla_rope caches must be contiguous float32 [cache_len, {rot}]")
    q_out = torch.empty((n, heads, rot), dtype=q.dtype, device=q.device)
    k_out = torch.empty((n, rot), dtype=k_pe.dtype, device=k_pe.device)
    kv_c, kv_w, eps = norm if norm is not None else (k_pe, k_pe, 0.0)  # unread without the third program
    kv_out = torch.empty(kv_c.shape, dtype=kv_c.dtype, device=kv_c.device) if norm is not None else None
    lora = kv_c.shape[-1] if norm is not None else 1
    block_l = triton.next_power_of_2(lora)
    if n:
        half = rot // 2
        block_half = triton.next_power_of_2(half)
        # With the norm: rms_norm's warps for this width, so its reduction runs in the same order.
        warps = min(max(block_l // 256, 1), 16) if norm is not None else 4
        mla_rope_kernel[(n, 2 if norm is None else 3)](
            positions, q[..., nope_dim:], k_pe, q_out, k_out, cos_cache, sin_cache,
            q.stride(0), q.stride(1), k_pe.stride(0), heads,
            kv_c, kv_w, kv_out if kv_out is not None else k_out, kv_c.stride(0), lora, float(eps),
            ROT=rot, HALF=half, BLOCK_H=min(triton.next_power_of_2(heads), max(1, 4096 // block_half)),
            BLOCK_HALF=block_half, INTERLEAVED=bool(interleaved), BLOCK_L=block_l, num_warps=warps, **_pdl(q),
            enable_fp_fusion=False,  # the rope's products rounded before their sum, as rotary_kernel's
        )
    return q_out, k_out, kv_out


class TritonSiluAndMul(TritonOp):
    """`silu_and_mul(x) -> out`; x: [..., 2 * d] (gate, then up), out: [..., d]."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 2:
            raise UnsupportedTensorError(f"silu_and_mul: last dim {x.shape[-1]} is odd")
        d = x.shape[-1] // 2
        x2 = _rows(x, 2 * d, "silu_and_mul input")
        out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
        if x2.shape[0] and d:
            block = min(triton.next_power_of_2(d), SILU_BLOCK)
            silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
                x2, out, x2.stride(0), out.stride(0), d, BLOCK=block, num_warps=4, **_pdl(x2),
            )
        return out.view(*x.shape[:-1], d)


class TritonLinearSmallM(TritonOp):
    """`linear_small_m(x, weight, bias) -> y`: an unquantized 16-bit linear layer's F.linear as a Triton GEMV
    for steps of at most a plan's `max_m` rows (linear_small_m.py), cuBLAS above. Binds only into layers
    whose (N, K) has a measured plan for this device (`linear_configs/<device>.json`): without one, nothing
    changes. On the CPU (interpreter, tests) the plans are the file named `cpu.json`."""

    def __init__(self) -> None:
        self._plans: dict = {}

    def supports(self, device_type: str, dtype: torch.dtype) -> bool:
        if dtype not in (torch.bfloat16, torch.float16) or not super().supports(device_type, dtype):
            return False
        name = torch.cuda.get_device_name() if device_type == "cuda" else "cpu"
        self._plans = load_plans(name, str(dtype).removeprefix("torch."))
        return bool(self._plans)

    def supports_layer(self, layer: torch.nn.Module) -> bool:
        weight = getattr(layer, "weight", None)
        return (getattr(layer, "quant_method", None) is None and isinstance(weight, torch.Tensor)
                and weight.dim() == 2 and tuple(weight.shape) in self._plans)

    def __call__(
        self,
        x: torch.Tensor,  # [M, K]
        weight: torch.Tensor,  # [N, K]
        bias: torch.Tensor | None,  # [N] or None
    ) -> torch.Tensor:  # [M, N] = F.linear(x, weight, bias)
        plan = self._plans.get(weight.shape)  # torch.Size hashes as the (N, K) tuple
        if (plan is None or x.dim() != 2 or x.shape[0] > plan.max_m or x.stride(1) != 1
                or x.dtype != weight.dtype):  # static per CUDA graph bucket; eager prefill steps: cuBLAS
            return torch.nn.functional.linear(x, weight, bias)
        return linear_small_m(x, weight, bias, plan)
