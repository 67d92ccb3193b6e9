"""Block FP8 (DeepSeek-V3's layout) through cuBLAS's block-scaled FP8 GEMM: `torch.nn.functional.scaled_mm`
with 1 x 128 activation groups (`ScalingType.BlockWise1x128`) and 128 x 128 weight blocks
(`BlockWise128x128`), cuBLASLt 12.9+ on sm90 (torch serves this recipe on Hopper only; torch 2.10+).

What cuBLASLt reads, and how this module gives it without a copy per call:
- activations e4m3 [M', K] row-major, M' = M rounded up to 4, and their scales float32 [M', K / 128]
  token-major (strides (1, M')): the scale columns must start 16-byte aligned. `quant_fp8` writes both
  in that layout in its one launch, the padding rows as zeros; the output's padding rows are sliced off.
- the weight e4m3 [N, K] as is (passed transposed: column-major [K, N]), and its `weight_scale_inv`
  [N / 128, K / 128] as is when K / 128 is a multiple of 4; otherwise a copy padded to
  [N / 128, round_up(K / 128, 4)] made once at load (`weight_scales`; cuBLASLt's 16-byte alignment of
  the K-block dimension -- unpadded it computes wrong numbers, it does not fail).
- N and K multiples of 128: a partial edge block (DeepSeek's kv_a_proj, 576 rows) stays on Triton.

`misfit` says why a layer cannot take this path (shapes, arch, torch), `probe` runs one tiny GEMM per
device, dtype and K padding at load and checks it against float64 (a torch or cuBLAS without the recipe,
or with a different layout contract, fails there instead of in a step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from keel.layers.fp8_utils import FP8

BLOCK = (128, 128)
ROWS_MULTIPLE = 4  # M padded to this: the token-major scales' columns 16-byte aligned
_K_BLOCKS_MULTIPLE = 4  # the weight scales' K blocks padded to this (16 bytes of float32)
DTYPES = (torch.bfloat16, torch.float32)  # output dtypes torch's tests cover for this recipe
_SCALING = getattr(F, "ScalingType", None)
HAS_API = (hasattr(F, "scaled_mm") and _SCALING is not None
           and all(hasattr(_SCALING, t) for t in ("BlockWise1x128", "BlockWise128x128")))
_probed: dict[tuple, str | None] = {}  # (device, dtype, K padded) -> None (works) or why not


def misfit(n: int, k: int, activation: str, block: tuple[int, int] | None, dtype: torch.dtype,
           capability: tuple[int, int]) -> str | None:
    """Why a block fp8 weight [n, k] cannot run here (None: shapes, arch and torch allow it)."""
    if activation != "dynamic_group" or block is None or tuple(block) != BLOCK:
        return f"activations {activation!r} / weight blocks {block}: cuBLAS scales 1x128 groups x 128x128 blocks"
    if capability != (9, 0):
        return f"sm{capability[0]}{capability[1]}: torch serves the 1x128 x 128x128 recipe on sm90 only"
    if n % 128 or k % 128:
        return f"[N, K] = [{n}, {k}] ends in a partial 128 block"
    if dtype not in DTYPES:
        return f"model dtype {dtype} (cuBLAS block-scaled output served for {[str(d) for d in DTYPES]})"
    if not HAS_API:
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm with block-wise ScalingType"
    return None


def weight_scales(scale: torch.Tensor) -> torch.Tensor:
    """The weight's block scales [N / 128, K / 128] as cuBLAS reads them: themselves when K / 128 is a
    multiple of 4, else a copy padded with ones to [N / 128, round_up(K / 128, 4)] (made once, at load)."""
    pad = -scale.shape[1] % _K_BLOCKS_MULTIPLE
    return scale if pad == 0 else F.pad(scale, (0, pad), value=1.0).contiguous()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M', K], float32 scales [M', K / 128] with strides (1, M')), M' = M rounded up
    to 4, the padding rows zero: cuBLAS's operand layout, written by quant_fp8's one launch."""
    from keel_quantization.fp8_quant_triton import quant_fp8

    m, k = x.shape
    rows = -(-m // ROWS_MULTIPLE) * ROWS_MULTIPLE
    q = torch.empty(rows, k, dtype=FP8, device=x.device)
    s = torch.empty(k // BLOCK[1], rows, dtype=torch.float32, device=x.device).t()  # token-major
    return quant_fp8(x, BLOCK[1], out=(q, s))


def gemm(
    x: torch.Tensor,  # [M, K] in the model dtype (bf16 / fp32)
    weight: torch.Tensor,  # e4m3 [N, K]
    scales: torch.Tensor,  # float32 [N / 128, round_up(K / 128, 4)]: `weight_scales(weight_scale_inv)`
) -> torch.Tensor:  # [M, N] in x's dtype
    m, k = x.shape
    k_blocks = -(-(k // BLOCK[1]) // _K_BLOCKS_MULTIPLE) * _K_BLOCKS_MULTIPLE
    if scales.shape != (weight.shape[0] // BLOCK[0], k_blocks):
        raise ValueError(f"cublas_block: weight scales {tuple(scales.shape)} are not weight_scales() of a "
                         f"{tuple(weight.shape)} weight")
    a_q, a_s = quantize_activations(x)
    return gemm_quantized(a_q, a_s, m, weight, scales, x.dtype)


def gemm_quantized(
    a_q: torch.Tensor,  # e4m3 [M', K], M' = m rounded up to ROWS_MULTIPLE (`quantize_activations`' layout)
    a_s: torch.Tensor,  # float32 [M', K / 128], strides (1, M')
    m: int,  # the real rows
    weight: torch.Tensor,  # e4m3 [N, K]
    scales: torch.Tensor,  # `weight_scales(weight_scale_inv)`
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [m, N]
    """The GEMM on activations already in cuBLAS's layout (quantized here, or by their producer)."""
    out = F.scaled_mm(a_q, weight.t(), a_s, _SCALING.BlockWise1x128, scales.t(), _SCALING.BlockWise128x128,
                      output_dtype=out_dtype)
    return out if out.shape[0] == m else out[:m]


def probe(device: torch.device, dtype: torch.dtype, pad_k: bool) -> str | None:
    """One small GEMM on `device` (once per device, dtype and K padding) against float64 on the operands it
    multiplies: None if it matches, else what went wrong (an error or the mismatch)."""
    key = (str(device), dtype, pad_k)
    if key not in _probed:
        _probed[key] = _run_probe(device, dtype, pad_k)
    return _probed[key]


def _spread(block: tuple[int, int], shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """A factor 2^-4 .. 2^4 per (block[0] x 128) block of `shape`: a scale read from the wrong block is off
    by 2x or more, not by the few percent random blocks differ."""
    from keel_quantization import fp8_math

    blocks = (-(-shape[0] // block[0]), shape[1] // 128)
    exps = torch.randint(-4, 5, blocks, device=gen.device, generator=gen).float()
    return fp8_math.expand_blocks(torch.exp2(exps), (block[0], 128), shape)


def _run_probe(device: torch.device, dtype: torch.dtype, pad_k: bool) -> str | None:
    from keel.layers.fp8_utils import dequant_per_token_group
    from keel_quantization import fp8_math

    m, n, k = 5, 256, 384 if pad_k else 512  # M pads to 8; K / 128 = 3 pads to 4
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, generator=gen) * _spread((1, 128), (m, k), gen)
    w = torch.randn(n, k, device=device, generator=gen) / k**0.5 * _spread(BLOCK, (n, k), gen)
    x = x.to(dtype)
    w_q, w_s = fp8_math.quantize_blocks(w, BLOCK)
    try:
        got = gemm(x, w_q, weight_scales(w_s)).double()
        a_q, a_s = quantize_activations(x)
    except Exception as e:  # noqa: BLE001 -- any failure (torch's checks, cuBLASLt's status) means Triton
        return f"the probe GEMM failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    want = (dequant_per_token_group(a_q[:m], a_s[:m], BLOCK[1], torch.float64)
            @ fp8_math.dequantize(w_q, w_s, BLOCK, torch.float64).T)
    err = ((got - want).abs().max() / want.abs().max()).item()
    tol = 1e-2  # bf16 output rounding and fp8 MMA accumulation pass; a misread scale is off by 2x or more
    return None if err <= tol else f"the probe GEMM is off by {err:.2e} of its largest output (> {tol})"
