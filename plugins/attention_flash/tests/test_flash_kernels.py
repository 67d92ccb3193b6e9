"""triton_flash kernels against the float64 reference beyond the conformance suite: forced split-K
decode (uneven, more splits than tiles), long contexts, head size 256, block size 128, sizes that are
multiples of nothing, GQA groups that are not powers of two, and poisoned output buffers."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from keel_attention_flash.backend import TritonFlashAttentionBackend
from keel_attention_flash.impl import TritonFlashAttentionImpl, choose_num_splits
from keel_attention_flash.kernels import _q_operand

from keel.attention.backend import AttentionLayerConfig
from keel.layers.fp8_utils import FP8
from keel.layers.kv_scales import quantize_kv
from keel.testing.attention import AttentionCase, make_step
from keel.testing.reference import ref_varlen_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def _run(case: AttentionCase, dtype: torch.dtype, seed: int, splits: int | None = None,
         fp8_scales: tuple[float, float] | None = None, fp8_words: bool | None = None,
         words_ahead: bool = True, blocks_ahead: bool | None = None) -> None:
    """`fp8_scales` (k_scale, v_scale): an e4m3 cache, the context written by torch's quantize_kv, the new
    tokens by the kernel; the reference reads it as torch_paged does, (stored * scale) rounded to `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    step, num_blocks, (slots, k, v) = make_step(case, gen, dtype, DEVICE)
    spec_shape = (2, num_blocks, case.block_size, case.num_kv_heads, case.head_size)
    layer = AttentionLayerConfig(case.num_heads, case.num_kv_heads, case.head_size, 1 / math.sqrt(case.head_size),
                                 dtype, case.block_size, sliding_window=case.sliding_window,
                                 kv_cache_dtype=FP8 if fp8_scales else None)
    impl = TritonFlashAttentionImpl(layer, decode_splits=splits, decode_fp8_words=fp8_words,
                                    decode_words_ahead=words_ahead, decode_blocks_ahead=blocks_ahead)
    keys, values = step.keys, step.values
    if fp8_scales:
        scales = [torch.tensor([s], device=DEVICE) for s in fp8_scales]
        impl.set_kv_scales(*scales)
        cache = torch.full(spec_shape, 0x7F, dtype=torch.uint8, device=DEVICE).view(FP8)  # e4m3fn NaN
        k, v = quantize_kv(k, scales[0], FP8), quantize_kv(v, scales[1], FP8)
        keys = [(quantize_kv(t, scales[0], FP8).float() * scales[0]).to(dtype) for t in keys]
        values = [(quantize_kv(t, scales[1], FP8).float() * scales[1]).to(dtype) for t in values]
    else:
        cache = torch.full(spec_shape, float("nan"), dtype=dtype, device=DEVICE)
    flat = cache.view(2, -1, case.num_kv_heads, case.head_size)
    flat[0, slots], flat[1, slots] = k, v
    md = TritonFlashAttentionBackend.get_metadata_builder(torch.device(DEVICE)).build(step.common)
    # Poison: NaN-filled memory freed just before, so an unwritten output row is caught.
    junk = torch.full((step.q.numel() * 8,), float("nan"), dtype=dtype, device=DEVICE)
    del junk
    out = impl.forward(step.q, step.k, step.v, cache, md)
    n = step.num_actual_tokens
    assert torch.isfinite(out).all()
    ref = ref_varlen_attention(step.q[:n], keys, values, list(case.query_lens),
                               scale=1 / math.sqrt(case.head_size), sliding_window=case.sliding_window)
    tol = TOL[dtype]
    torch.testing.assert_close(out[:n].double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("splits", [1, 3, 16])
def test_split_decode_matches_reference(splits: int) -> None:
    case = AttentionCase(context_lens=(0, 200, 37, 129), query_lens=(1, 1, 1, 1), num_heads=6, num_kv_heads=2,
                         head_size=64, block_size=16, num_padding_tokens=2)
    _run(case, torch.float32, 100 + splits, splits=splits)


def test_split_decode_sliding_window() -> None:
    case = AttentionCase(context_lens=(150, 40), query_lens=(1, 1), num_heads=4, num_kv_heads=1,
                         head_size=64, block_size=32, sliding_window=70)
    _run(case, torch.float32, 7, splits=4)


def test_long_decode_bf16_default_splits() -> None:
    case = AttentionCase(context_lens=(700, 5), query_lens=(1, 1), num_heads=8, num_kv_heads=2,
                         head_size=128, block_size=64)
    _run(case, torch.bfloat16, 8)


def test_head_256_block_128_mixed() -> None:
    case = AttentionCase(context_lens=(0, 130, 3), query_lens=(45, 1, 19), num_heads=2, num_kv_heads=1,
                         head_size=256, block_size=128)
    _run(case, torch.float32, 9)


def test_odd_group_and_long_chunk() -> None:
    # GQA group of 3 (padded rows), a query chunk longer than one tile, context straddling pages.
    case = AttentionCase(context_lens=(33, 0), query_lens=(77, 2), num_heads=6, num_kv_heads=2, head_size=64,
                         block_size=16, num_padding_tokens=3)
    _run(case, torch.bfloat16, 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context_lens,query_lens,splits", [
    ((0, 90, 37), (1, 1, 1), 1),  # decode, one program per request and KV head
    ((0, 90, 37), (1, 1, 1), 3),  # split-K: v_scale applied to each split's partial
    ((21, 0), (5, 19), None),  # varlen: a chunk over a cached prefix next to a prefill
])
def test_fp8_cache_with_scales_folded_out_of_the_tiles(context_lens, query_lens, splits, dtype) -> None:
    """The kernels read raw e4m3 tiles (exact in q's dtype) with k_scale folded into the score scale and
    v_scale into the output; the reference rounds each stored value * scale to q's dtype first. Tolerance: the
    unquantized path's (TOL). float32: the two differ by float32 rounding alone. bfloat16: the fold skips the
    reference's rounding of every dequantized element (<= 2^-9 relative, unbiased, averaged over 64-wide dots
    and the softmax-weighted sum of values), far inside the error of the bf16 q, p and output the tolerance
    already covers. Scales != 1 (the stored values span e4m3's range), GQA group 3, padding tokens."""
    case = AttentionCase(context_lens=context_lens, query_lens=query_lens, num_heads=6, num_kv_heads=2,
                         head_size=64, block_size=16, num_padding_tokens=2)
    _run(case, dtype, 12 + sum(context_lens), splits=splits, fp8_scales=(0.05, 0.02))


@pytest.mark.parametrize("splits,ahead", [(1, True), (3, True), (1, False), (3, False)])
def test_fp8_cache_read_as_words(splits, ahead) -> None:
    """Decode reading the e4m3 cache as int32 words, four values each converted in registers (interpreted: byte
    by byte; compiled: inline PTX), against the same reference: every word's bytes land at their head positions,
    through masked tiles, page boundaries and splits, with the next tile's words loaded ahead and without.
    Head size 64, 2 KV heads: words never straddle heads."""
    case = AttentionCase(context_lens=(0, 90, 37), query_lens=(1, 1, 1), num_heads=6, num_kv_heads=2,
                         head_size=64, block_size=16, num_padding_tokens=2)
    _run(case, torch.bfloat16, 40 + splits, splits=splits, fp8_scales=(0.05, 0.02), fp8_words=True,
         words_ahead=ahead)


@pytest.mark.parametrize("cache,splits", [("bf16", 1), ("fp8", 3), ("words", 1), ("words", 3)])
def test_decode_with_block_numbers_loaded_ahead(cache, splits) -> None:
    """The decode loop with each tile's block numbers loaded an iteration early (BLOCKS_AHEAD): over a bf16
    cache, an fp8 cache read as bytes and as words loaded where attended, through masked tiles, page boundaries,
    splits (a split's last prefetch runs past its slice and is masked off) and an empty context."""
    case = AttentionCase(context_lens=(0, 90, 37), query_lens=(1, 1, 1), num_heads=6, num_kv_heads=2,
                         head_size=64, block_size=16, num_padding_tokens=2)
    fp8 = {} if cache == "bf16" else {"fp8_scales": (0.05, 0.02), "fp8_words": cache == "words", "words_ahead": False}
    _run(case, torch.bfloat16, 60 + splits, splits=splits, blocks_ahead=True, **fp8)


def test_words_ahead_follows_the_launch_programs(monkeypatch) -> None:
    """The word path loads the next tile ahead below _WORDS_INLINE_MIN_PROGRAMS programs and inline from it on
    (always ahead while it is unset); a tuning run's decode_words_ahead overrides both."""
    from keel_attention_flash import impl as flash_impl

    layer = AttentionLayerConfig(32, 8, 128, 128**-0.5, torch.bfloat16, 16, kv_cache_dtype=FP8)
    by_rule = TritonFlashAttentionImpl(layer, decode_fp8_words=True)
    monkeypatch.setattr(flash_impl, "_WORDS_INLINE_MIN_PROGRAMS", None)
    assert by_rule._words_ahead(8192)
    monkeypatch.setattr(flash_impl, "_WORDS_INLINE_MIN_PROGRAMS", 2048)
    assert by_rule._words_ahead(512) and not by_rule._words_ahead(2048) and not by_rule._words_ahead(8192)
    assert TritonFlashAttentionImpl(layer, decode_fp8_words=True, decode_words_ahead=True)._words_ahead(8192)
    assert not TritonFlashAttentionImpl(layer, decode_fp8_words=True, decode_words_ahead=False)._words_ahead(1)


def test_fp8_words_refused_where_they_cannot_apply() -> None:
    """Asked for where it cannot run (a float32 model's tiles stay float32), the word path is an error, not a
    silent fallback."""
    layer = AttentionLayerConfig(4, 2, 64, 0.125, torch.float32, 16, kv_cache_dtype=FP8)
    with pytest.raises(ValueError, match="decode_fp8_words"):
        TritonFlashAttentionImpl(layer, decode_fp8_words=True)


def test_choose_num_splits() -> None:
    assert choose_num_splits(1, 8, 100, 132) == 1  # short context: one split
    assert choose_num_splits(1, 8, 4096, 132) == 16  # one long request: split up to the cap
    assert choose_num_splits(256, 8, 4096, 132) == 1  # the batch alone fills the device
    assert choose_num_splits(64, 8, 4096, 132) == 1  # H200-measured: one split already wins at 64 x 8 heads
    assert choose_num_splits(256, 1, 4096, 132, programs_per_sm=1) == 1  # MLA: one program per SM
    assert choose_num_splits(64, 1, 4096, 132, programs_per_sm=1) == 4
    for b in (1, 3, 32, 200):
        s = choose_num_splits(b, 8, 4096, 132)
        assert s & (s - 1) == 0 and 1 <= s <= 16


def test_default_decode_launch_follows_the_split_count(monkeypatch) -> None:
    """No fixed launch: one split takes the batch launch (an fp8 cache its own, 64-token tiles), a split context
    the long-tile one."""
    import keel_attention_flash.impl as impl_mod

    seen = []
    real = impl_mod.kernels.split_decode_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((grid[2], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"]))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(impl_mod.kernels, "split_decode_kernel", Spy())
    case = AttentionCase(context_lens=(40, 7), query_lens=(1, 1), num_heads=4, num_kv_heads=2, head_size=64,
                         block_size=16)
    for splits in (1, 4):
        _run(case, torch.float32, 11, splits=splits)
    _run(case, torch.bfloat16, 11, splits=1, fp8_scales=(0.05, 0.02))
    assert seen == [(1, *impl_mod._BATCH_LAUNCH), (4, *impl_mod._SPLIT_LAUNCH), (1, *impl_mod._BATCH_LAUNCH_FP8)]
    # from _WORDS_INLINE_MIN_PROGRAMS programs (here 4: 2 requests x 2 KV heads) the fp8 cache takes the
    # many-program launch, whatever a tuning run's decode_words_ahead says
    monkeypatch.setattr(impl_mod, "_WORDS_INLINE_MIN_PROGRAMS", 4)
    _run(case, torch.bfloat16, 11, splits=1, fp8_scales=(0.05, 0.02))
    _run(case, torch.bfloat16, 11, splits=1, fp8_scales=(0.05, 0.02), words_ahead=True)
    assert seen[3:] == [(1, *impl_mod._BATCH_LAUNCH_FP8_MANY)] * 2


@triton.jit
def _q_operand_probe(q_ptr, op_ptr, scale_ptr, ROWS: tl.constexpr, D: tl.constexpr):
    r, d = tl.arange(0, ROWS), tl.arange(0, D)
    q = tl.load(q_ptr + r[:, None] * D + d[None, :])
    op, scale = _q_operand(q, 0.5, True)
    tl.store(op_ptr + r[:, None] * D + d[None, :], op)
    tl.store(scale_ptr + r, scale)


def test_fp8_cache_q_operand_keeps_bf16_rows_in_fp16_range() -> None:
    """With an fp8 cache a bf16 q enters the score dot as fp16, divided per row by a power of two (kernels.
    _q_operand): rows far outside fp16's range (1e30 would be inf, 1e-30 zero) come back, times the row's
    scale, within fp16's rounding of the row's largest element; a zero row stays zero."""
    gen = torch.Generator().manual_seed(3)
    mags = torch.tensor([1e30, 1e-30, 1.0, 70000.0, 0.0, 3e-5, 1e4, 2.0 ** -130])
    q = (torch.randn(8, 32, generator=gen) * mags[:, None]).to(torch.bfloat16)
    op = torch.empty(8, 32, dtype=torch.float16, device=DEVICE)
    scale = torch.empty(8, dtype=torch.float32, device=DEVICE)
    _q_operand_probe[(1,)](q.to(DEVICE), op, scale, ROWS=8, D=32)
    op, scale = op.cpu().double(), scale.cpu().double()
    assert torch.isfinite(op).all() and (op.abs().amax(1) < 2.0).all()
    back = op * (scale / 0.5)[:, None]
    top = q.double().abs().amax(1, keepdim=True)
    assert ((back - q.double()).abs() <= top * 2.0**-11)[:7].all()
    assert (back[4] == 0).all()  # a zero row
    assert (back[7] == 0).all()  # float32 subnormals (no exponent to scale by) read as 0: scores under 1e-36
