"""torch_paged internals the conformance suite cannot see: plan reuse, batching, skipped slots."""

import math

import torch
from keel_attention_torch.backend import TorchPagedAttentionBackend

from keel.testing.attention import AttentionCase, make_step
from keel.testing.reference import ref_varlen_attention

B = TorchPagedAttentionBackend


def _step(case: AttentionCase, seed: int = 0):
    step, num_blocks, (slots, k, v) = make_step(case, torch.Generator().manual_seed(seed), torch.float32, "cpu")
    cache = torch.full(B.kv_cache_shape(num_blocks, _spec(case)), float("nan"))
    flat = cache.view(2, -1, case.num_kv_heads, case.head_size)
    flat[0, slots], flat[1, slots] = k, v
    return step, cache


def _spec(case: AttentionCase):
    from keel.kv_cache.spec import FullAttentionSpec

    return FullAttentionSpec(case.block_size, torch.float32, case.num_kv_heads, case.head_size)


def _impl(case: AttentionCase, window=None):
    from keel.attention.backend import AttentionLayerConfig

    return B.get_impl(AttentionLayerConfig(case.num_heads, case.num_kv_heads, case.head_size,
                                           1 / math.sqrt(case.head_size), torch.float32, case.block_size,
                                           sliding_window=window))


def test_plan_is_built_once_per_window_and_reused():
    case = AttentionCase(context_lens=(3, 0), query_lens=(1, 5), head_size=16, block_size=4)
    step, _ = _step(case)
    md = B.get_metadata_builder(torch.device("cpu")).build(step.common)
    assert md.plan(None) is md.plan(None)
    assert md.plan(8) is md.plan(8) and md.plan(8) is not md.plan(None)


def test_pure_decode_is_one_batch_and_unmasked_when_lengths_match():
    case = AttentionCase(context_lens=(7, 7, 7), query_lens=(1, 1, 1), head_size=16, block_size=4)
    step, _ = _step(case)
    md = B.get_metadata_builder(torch.device("cpu")).build(step.common)
    plan = md.plan(None)
    assert plan.prefill == [] and plan.decode.num_reqs == 3 and plan.decode.key_len == 8
    assert plan.decode.mask is None and plan.decode.rows == slice(0, 3)


def test_window_limits_decode_gather_width():
    case = AttentionCase(context_lens=(40, 3), query_lens=(1, 1), head_size=16, block_size=4)
    step, _ = _step(case)
    plan = B.get_metadata_builder(torch.device("cpu")).build(step.common).plan(6)
    assert plan.decode.key_len == 6 and plan.decode.mask is not None


def test_decodes_after_prefill_use_row_indices():
    case = AttentionCase(context_lens=(0, 5, 9), query_lens=(4, 1, 1), head_size=16, block_size=4)
    step, _ = _step(case)
    plan = B.get_metadata_builder(torch.device("cpu")).build(step.common).plan(None)
    assert plan.decode.rows == slice(4, 6) and len(plan.prefill) == 1


def test_slot_minus_one_among_real_tokens_is_not_written():
    case = AttentionCase(context_lens=(0,), query_lens=(6,), head_size=16, block_size=4)
    step, cache = _step(case)
    skipped = int(step.common.slot_mapping[2])
    step.common.slot_mapping[2] = -1
    md = B.get_metadata_builder(torch.device("cpu")).build(step.common)
    assert md.write_rows.tolist() == [0, 1, 3, 4, 5]
    _impl(case).forward(step.q, step.k, step.v, cache, md)
    flat = cache.view(2, -1, case.num_kv_heads, case.head_size)
    assert torch.isnan(flat[:, skipped]).all()
    assert torch.equal(flat[0, step.common.slot_mapping[3:]], step.k[3:])


def test_padding_rows_are_zero():
    case = AttentionCase(context_lens=(2, 0), query_lens=(1, 3), head_size=16, block_size=4, num_padding_tokens=4)
    step, cache = _step(case)
    md = B.get_metadata_builder(torch.device("cpu")).build(step.common)
    out = _impl(case).forward(step.q, step.k, step.v, cache, md)
    assert torch.equal(out[4:], torch.zeros_like(out[4:]))


def test_long_prefill_with_long_prefix_matches_reference():
    # Larger than the conformance cases: several blocks of prefix, a chunk spanning many blocks, GQA 4:1.
    case = AttentionCase(context_lens=(150, 0), query_lens=(70, 1), num_heads=8, num_kv_heads=2, head_size=32,
                         block_size=16)
    step, cache = _step(case, seed=3)
    md = B.get_metadata_builder(torch.device("cpu")).build(step.common)
    out = _impl(case).forward(step.q, step.k, step.v, cache, md)
    ref = ref_varlen_attention(step.q, step.keys, step.values, list(case.query_lens), scale=1 / math.sqrt(32))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
