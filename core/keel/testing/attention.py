"""Conformance suite for attention backends: subclass it in your plugin's tests.

    from keel.testing.attention import AttentionBackendConformance

    class TestMyBackend(AttentionBackendConformance):
        backend = MyBackend
        device = "cuda"
        dtype = torch.bfloat16

Every case builds a step from fresh random inputs: a paged cache poisoned with NaN everywhere except
the slots holding earlier context, random non-contiguous block tables, padding tokens with slot -1,
then checks the backend's output against a float64 dense reference computed from the logical K/V
sequence (`keel.testing.reference`) and checks that the cache afterwards holds exactly the new K/V at
their slots and nothing else changed. Backends with a cache layout other than
(2, num_blocks, block_size, num_kv_heads, head_size) set `standard_layout = False` and override
`write_cache`. An impl that offers the optional `write_kv_rope` (the rope fused into its cache write) is
checked against the rope module followed by its plain forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import pytest
import torch

from keel.attention.backend import (
    AttentionImpl,
    AttentionLayerConfig,
    AttentionMetadataBuilder,
    BackendCapabilities,
    BackendRequest,
)
from keel.attention.metadata import CommonAttentionMetadata
from keel.kv_cache.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from keel.testing.reference import ref_varlen_attention

__all__ = ["AttentionBackendConformance", "AttentionCase", "StepInputs", "make_generation", "make_step"]

_DEFAULT_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@dataclass(frozen=True)
class AttentionCase:
    """One step's shape: per request, tokens already cached (`context_lens`) and new (`query_lens`)."""

    context_lens: tuple[int, ...] = (0,)
    query_lens: tuple[int, ...] = (8,)
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 64
    block_size: int = 16
    sliding_window: int | None = None
    num_padding_tokens: int = 0
    extra_blocks: int = 3  # allocated but never used by any request (stay NaN)
    fused_qkv: bool = False  # q, k, v as strided views of one [tokens, (heads + 2 kv_heads) * size] tensor


@dataclass
class StepInputs:
    """A step's tensors on the device, plus the logical truth the reference needs."""

    q: torch.Tensor  # [num_tokens, num_heads, head_size] (padding rows included)
    k: torch.Tensor  # [num_tokens, num_kv_heads, head_size]
    v: torch.Tensor  # [num_tokens, num_kv_heads, head_size]
    common: CommonAttentionMetadata
    new_slots: torch.Tensor  # [num_actual_tokens] int64
    keys: list[torch.Tensor]  # per request [context_len + query_len, num_kv_heads, head_size]
    values: list[torch.Tensor]

    @property
    def num_actual_tokens(self) -> int:
        return self.common.num_actual_tokens


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)


def _allocate_blocks(case: AttentionCase, totals: list[int], gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Random, non-contiguous block tables ([num_reqs, max_blocks + 1] int32, 0 = null) for `totals`."""
    bs = case.block_size
    needed = [-(-t // bs) for t in totals]
    num_blocks = 1 + sum(needed) + case.extra_blocks
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(totals), max(needed) + 1, dtype=torch.int32)
    for i, n in enumerate(needed):
        table[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    return table, num_blocks


def _build_step(case: AttentionCase, table: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                gen: torch.Generator, dtype: torch.dtype, device: str) -> StepInputs:
    bs, heads, kv_heads, size = case.block_size, case.num_heads, case.num_kv_heads, case.head_size
    new_slots, new_k, new_v = [], [], []
    for i, (ctx, n) in enumerate(zip(case.context_lens, case.query_lens)):
        pos = torch.arange(ctx, ctx + n)
        new_slots.append(table[i].long()[pos // bs] * bs + pos % bs)
        new_k.append(keys[i][ctx : ctx + n])
        new_v.append(values[i][ctx : ctx + n])
    pad = case.num_padding_tokens
    num_actual = sum(case.query_lens)
    slots = torch.cat(new_slots)
    k = torch.cat([*new_k, _randn(gen, pad, kv_heads, size, dtype=dtype, device=device)])
    v = torch.cat([*new_v, _randn(gen, pad, kv_heads, size, dtype=dtype, device=device)])
    q = _randn(gen, num_actual + pad, heads, size, dtype=dtype, device=device)
    seq_lens = torch.tensor([c + n for c, n in zip(case.context_lens, case.query_lens)], dtype=torch.int32)
    qsl = torch.zeros(len(case.query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(case.query_lens), 0)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq_lens.to(device),
        seq_lens_cpu=seq_lens, block_table=table.to(device),
        slot_mapping=torch.cat([slots, torch.full((pad,), -1, dtype=torch.long)]).to(device),
        num_reqs=len(case.query_lens), num_actual_tokens=num_actual, max_query_len=max(case.query_lens),
        max_seq_len=int(seq_lens.max()), block_size=bs,
    )
    if case.fused_qkv:  # what a model's fused QKV projection hands the attention layer
        qkv = torch.cat([t.flatten(1) for t in (q, k, v)], dim=1)
        q, k, v = (t.view(-1, h, size) for t, h in
                   zip(qkv.split([heads * size, kv_heads * size, kv_heads * size], dim=1), (heads, kv_heads, kv_heads)))
    return StepInputs(q, k, v, common, slots.to(device), keys, values)


def make_step(case: AttentionCase, gen: torch.Generator, dtype: torch.dtype, device: str
              ) -> tuple[StepInputs, int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Random inputs for one step -> (step, num_blocks, (slots, k, v) of the context cached before it).

    With a sliding window, blocks wholly before the window of a request's first new token are null in
    its block table (a sliding-window manager may have freed them) and their tokens are not cached.
    """
    totals = [c + n for c, n in zip(case.context_lens, case.query_lens)]
    table, num_blocks = _allocate_blocks(case, totals, gen)
    bs, w = case.block_size, case.sliding_window
    keys = [_randn(gen, t, case.num_kv_heads, case.head_size, dtype=dtype, device=device) for t in totals]
    values = [_randn(gen, t, case.num_kv_heads, case.head_size, dtype=dtype, device=device) for t in totals]
    prior_slots, prior_k, prior_v = [], [], []
    for i, ctx in enumerate(case.context_lens):
        if w is not None:
            for j in range(table.shape[1]):
                if (j + 1) * bs - 1 < ctx - w + 1:
                    table[i, j] = 0
        pos = torch.arange(ctx)
        blocks = table[i].long()[pos // bs]
        keep = blocks != 0
        prior_slots.append((blocks * bs + pos % bs)[keep])
        prior_k.append(keys[i][:ctx][keep.to(device)])
        prior_v.append(values[i][:ctx][keep.to(device)])
    step = _build_step(case, table, keys, values, gen, dtype, device)
    prior = (torch.cat(prior_slots).to(device), torch.cat(prior_k), torch.cat(prior_v))
    return step, num_blocks, prior


def make_generation(case: AttentionCase, gen: torch.Generator, dtype: torch.dtype, device: str,
                    prompt_lens: tuple[int, ...], chunk: int, decode_steps: int
                    ) -> tuple[list[tuple[AttentionCase, StepInputs]], int]:
    """Steps of a lockstep generation: prompts in chunks of `chunk` tokens, then `decode_steps` decodes.

    All steps share one block table; run them in order on one cache that starts all NaN.
    """
    totals = [p + decode_steps for p in prompt_lens]
    table, num_blocks = _allocate_blocks(case, totals, gen)
    keys = [_randn(gen, t, case.num_kv_heads, case.head_size, dtype=dtype, device=device) for t in totals]
    values = [_randn(gen, t, case.num_kv_heads, case.head_size, dtype=dtype, device=device) for t in totals]
    done = [0] * len(totals)
    steps = []
    while any(d < t for d, t in zip(done, totals)):
        active = [i for i in range(len(totals)) if done[i] < totals[i]]
        lens = [min(chunk, prompt_lens[i] - done[i]) if done[i] < prompt_lens[i] else 1 for i in active]
        step_case = replace(case, context_lens=tuple(done[i] for i in active), query_lens=tuple(lens))
        step_keys = [keys[i][: done[i] + n] for i, n in zip(active, lens)]
        step_values = [values[i][: done[i] + n] for i, n in zip(active, lens)]
        steps.append((step_case, _build_step(step_case, table[active], step_keys, step_values, gen, dtype,
                                             device)))
        for i, n in zip(active, lens):
            done[i] += n
    return steps, num_blocks


class AttentionBackendConformance:
    """Base class of a backend's conformance tests (pytest collects the `test_*` methods of subclasses)."""

    backend: ClassVar[Any] = None
    device: ClassVar[str] = "cpu"
    dtype: ClassVar[torch.dtype] = torch.float32
    atol: ClassVar[float | None] = None  # None: from dtype (1e-5 for float32)
    rtol: ClassVar[float | None] = None
    standard_layout: ClassVar[bool] = True
    seed: ClassVar[int] = 1234

    # ----- hooks a subclass may override -------------------------------------------------------------

    def write_cache(
        self,
        kv_cache: torch.Tensor,
        slots: torch.Tensor,  # [n] int64
        k: torch.Tensor,  # [n, num_kv_heads, head_size]
        v: torch.Tensor,  # [n, num_kv_heads, head_size]
    ) -> None:
        """Store K/V at cache slots the way the backend lays them out (standard layout by default)."""
        flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
        flat[0, slots] = k.to(kv_cache.dtype)
        flat[1, slots] = v.to(kv_cache.dtype)

    def head_sizes(self) -> tuple[int, ...]:
        """Head sizes to test: the small common ones the backend declares."""
        declared = self.backend.capabilities.head_sizes
        if declared is None:
            return (64, 80, 128)
        small = tuple(h for h in (64, 128, 80, 96, 32, 256) if h in declared)
        return small[:3] or tuple(sorted(declared))[:1]

    def block_sizes(self) -> tuple[int, ...]:
        declared = self.backend.capabilities.block_sizes
        if declared is None:
            return (16, 5, 1)
        return tuple(sorted(declared))[:2]

    # ----- helpers -----------------------------------------------------------------------------------

    @property
    def caps(self) -> BackendCapabilities:
        return self.backend.capabilities

    def tolerances(self) -> tuple[float, float]:
        default = _DEFAULT_TOL.get(self.dtype, 1e-2)
        return (self.atol if self.atol is not None else default, self.rtol if self.rtol is not None else default)

    def default_case(self, **overrides: Any) -> AttentionCase:
        fields: dict[str, Any] = {"head_size": self.head_sizes()[0], "block_size": self.block_sizes()[0]}
        fields.update(overrides)
        return AttentionCase(**fields)

    def layer_config(self, case: AttentionCase) -> AttentionLayerConfig:
        return AttentionLayerConfig(
            num_heads=case.num_heads,
            num_kv_heads=case.num_kv_heads,
            head_size=case.head_size,
            scale=1.0 / math.sqrt(case.head_size),
            dtype=self.dtype,
            block_size=case.block_size,
            sliding_window=case.sliding_window,
        )

    def spec(self, case: AttentionCase) -> KVCacheSpec:
        if case.sliding_window is not None:
            return SlidingWindowSpec(
                case.block_size, self.dtype, case.num_kv_heads, case.head_size, case.sliding_window
            )
        return FullAttentionSpec(case.block_size, self.dtype, case.num_kv_heads, case.head_size)

    def new_cache(self, case: AttentionCase, num_blocks: int) -> torch.Tensor:
        shape = self.backend.kv_cache_shape(num_blocks, self.spec(case))
        return torch.full(shape, float("nan"), dtype=self.dtype, device=self.device)

    def check_supported(self, case: AttentionCase) -> None:
        kind = "sliding_window" if case.sliding_window is not None else "full_attention"
        req = BackendRequest(self.layer_config(case), torch.device(self.device).type, kind)
        reasons = self.backend.validate(req)
        if reasons:
            pytest.skip(f"{self.backend.name} does not support this case: {reasons}")

    def run_step(self, case: AttentionCase, step: StepInputs, kv_cache: torch.Tensor, impl=None) -> None:
        """One forward step on `kv_cache` (already holding the step's earlier context); asserts all."""
        expected_cache = kv_cache.clone()
        n = step.num_actual_tokens
        self.write_cache(expected_cache, step.new_slots, step.k[:n], step.v[:n])
        builder = self.backend.get_metadata_builder(torch.device(self.device))
        metadata = builder.build(step.common)
        impl = impl or self.backend.get_impl(self.layer_config(case))
        _poison_allocator(step.q, self.device)
        out = impl.forward(step.q, step.k, step.v, kv_cache, metadata)
        self.check_output(case, step, out)
        torch.testing.assert_close(
            kv_cache, expected_cache, atol=0, rtol=0, equal_nan=True,
            msg=lambda m: f"{case}: cache after the step is not exactly old cache + new K/V at slots. {m}",
        )

    def check_output(self, case: AttentionCase, step: StepInputs, out: torch.Tensor) -> None:
        heads, size = case.num_heads, case.head_size
        assert out.shape == (step.q.shape[0], heads, size), f"{case}: output shape {tuple(out.shape)}"
        assert out.dtype == self.dtype, f"{case}: output dtype {out.dtype}, expected {self.dtype}"
        n = step.num_actual_tokens
        real = out[:n]
        assert torch.isfinite(real).all(), f"{case}: non-finite outputs at real tokens"
        ref = ref_varlen_attention(
            step.q[:n], step.keys, step.values, list(case.query_lens),
            scale=1.0 / math.sqrt(size), sliding_window=case.sliding_window,
        )
        atol, rtol = self.tolerances()
        torch.testing.assert_close(
            real.to(torch.float64), ref, atol=atol, rtol=rtol, msg=lambda m: f"{case}: {m}"
        )

    def run_case(self, case: AttentionCase, seed: int = 0) -> None:
        self.check_supported(case)
        gen = torch.Generator().manual_seed(self.seed + seed)
        step, num_blocks, prior = make_step(case, gen, self.dtype, self.device)
        kv_cache = self.new_cache(case, num_blocks)
        self.write_cache(kv_cache, *prior)
        self.run_step(case, step, kv_cache)

    # ----- protocol surface --------------------------------------------------------------------------

    def test_protocol_surface(self) -> None:
        b = self.backend
        assert b is not None, "set `backend` on the conformance subclass"
        assert isinstance(b.name, str) and b.name, "backend.name must be a non-empty string"
        assert isinstance(b.capabilities, BackendCapabilities)
        case = self.default_case()
        assert isinstance(b.get_metadata_builder(torch.device(self.device)), AttentionMetadataBuilder)
        assert isinstance(b.get_impl(self.layer_config(case)), AttentionImpl)

    def test_validate_accepts_supported(self) -> None:
        layer = self.layer_config(self.default_case())
        reasons = self.backend.validate(BackendRequest(layer, torch.device(self.device).type, "full_attention"))
        assert isinstance(reasons, list) and reasons == [], f"rejected a supported layer: {reasons}"
        if self.caps.supports_sliding_window and "sliding_window" in self.caps.kv_cache_kinds:
            layer = self.layer_config(self.default_case(sliding_window=8))
            assert self.backend.validate(BackendRequest(layer, torch.device(self.device).type, "sliding_window")) == []

    def test_validate_rejects_excluded(self) -> None:
        caps = self.caps
        base = self.layer_config(self.default_case())
        dev = torch.device(self.device).type
        bad: list[tuple[str, AttentionLayerConfig, str, str]] = [
            ("unknown KV cache kind", base, dev, "no_such_kv_cache_kind")
        ]
        other_dtypes = [d for d in (torch.float64, torch.float16, torch.bfloat16, torch.float32) if d not in caps.dtypes]
        if other_dtypes:
            bad.append(("dtype", replace(base, dtype=other_dtypes[0]), dev, "full_attention"))
        if caps.head_sizes is not None:
            bad.append(("head size", replace(base, head_size=max(caps.head_sizes) + 1), dev, "full_attention"))
        if caps.block_sizes is not None:
            bad.append(("block size", replace(base, block_size=max(caps.block_sizes) + 1), dev, "full_attention"))
        if caps.device_types is not None:
            bad.append(("device type", base, "no_such_device", "full_attention"))
        if "mla_latent" not in caps.kv_cache_kinds:
            bad.append(("MLA cache kind", base, dev, "mla_latent"))
        if not caps.supports_mla:
            bad.append(("MLA", replace(base, use_mla=True), dev, "full_attention"))
        if not caps.supports_sliding_window:
            bad.append(("sliding window", replace(base, sliding_window=8), dev, "sliding_window"))
        if not caps.supports_encoder:
            bad.append(("non-causal", replace(base, causal=False), dev, "full_attention"))
        if not caps.supports_soft_cap:
            bad.append(("soft cap", replace(base, logits_soft_cap=30.0), dev, "full_attention"))
        for what, layer, device_type, kind in bad:
            reasons = self.backend.validate(BackendRequest(layer, device_type, kind))
            assert isinstance(reasons, list) and all(isinstance(r, str) for r in reasons), what
            assert reasons, f"validate accepted an excluded {what}"

    def test_kv_cache_shape(self) -> None:
        for case in (self.default_case(num_kv_heads=2), self.default_case(num_kv_heads=1, sliding_window=8)):
            if case.sliding_window is not None and not self.caps.supports_sliding_window:
                continue
            spec = self.spec(case)
            shape = tuple(self.backend.kv_cache_shape(7, spec))
            elem = torch.empty((), dtype=self.dtype).element_size()
            assert math.prod(shape) * elem == 7 * spec.page_size_bytes, f"{shape} does not hold 7 pages of {spec}"
            if self.standard_layout:
                assert shape == (2, 7, case.block_size, case.num_kv_heads, case.head_size)

    # ----- correctness -------------------------------------------------------------------------------

    def test_mixed_prefill_decode(self) -> None:
        # Decodes interleaved with prefills and a chunk, so no backend can assume decodes come first.
        self.run_case(self.default_case(context_lens=(0, 17, 0, 40, 9), query_lens=(21, 1, 6, 1, 5)), 1)

    def test_chunked_prefill(self) -> None:
        self.run_case(self.default_case(context_lens=(32, 7), query_lens=(16, 13)), 2)

    def test_pure_decode(self) -> None:
        self.run_case(self.default_case(context_lens=(0, 5, 31, 16, 63), query_lens=(1,) * 5), 3)
        self.run_case(self.default_case(context_lens=(20, 20, 20), query_lens=(1,) * 3), 4)

    def test_gqa_mqa(self) -> None:
        for kv_heads in (1, 2, 4):
            case = self.default_case(num_heads=4, num_kv_heads=kv_heads, context_lens=(9, 0, 3), query_lens=(1, 7, 4))
            self.run_case(case, 10 + kv_heads)

    def test_head_sizes(self) -> None:
        for i, head_size in enumerate(self.head_sizes()):
            self.run_case(self.default_case(head_size=head_size, context_lens=(6, 0), query_lens=(1, 9)), 20 + i)

    def test_block_sizes(self) -> None:
        # Lengths deliberately straddle block boundaries (not multiples of the block size).
        for i, block_size in enumerate(self.block_sizes()):
            case = self.default_case(block_size=block_size, context_lens=(block_size + 3, 2 * block_size - 1, 0),
                                     query_lens=(1, block_size + 2, 2 * block_size + 1))
            self.run_case(case, 30 + i)

    def test_padding_tokens(self) -> None:
        self.run_case(self.default_case(context_lens=(4, 11), query_lens=(3, 1), num_padding_tokens=5), 40)
        self.run_case(self.default_case(context_lens=(4, 11), query_lens=(1, 1), num_padding_tokens=3), 41)

    def test_sliding_window(self) -> None:
        if not self.caps.supports_sliding_window:
            pytest.skip("backend declares no sliding window support")
        bs = self.block_sizes()[0]
        for i, window in enumerate((bs // 2 + 1, bs + 3, 4 * bs)):
            case = self.default_case(sliding_window=window, context_lens=(3 * bs, 0, bs + 5, 2 * bs + 1),
                                     query_lens=(1, 2 * bs + 3, 1, bs))
            self.run_case(case, 50 + i)

    def test_poisoned_output_buffers(self) -> None:
        # run_step poisons freed allocator memory before every forward; repeat to catch reuse by chance.
        for i in range(3):
            self.run_case(self.default_case(context_lens=(0, 12), query_lens=(5, 1), num_padding_tokens=2), 60 + i)

    def test_strided_qkv_views(self) -> None:
        case = self.default_case(context_lens=(0, 9, 3), query_lens=(7, 1, 1), num_padding_tokens=1, fused_qkv=True)
        self.run_case(case, 65)

    def test_rope_in_the_cache_write(self) -> None:
        """An impl offering `write_kv_rope` (the rope fused into its cache write; see `keel.layers.attention`)
        must leave the cache and give the output of the rope module followed by its plain forward: q and k
        as strided views of one projection, a partial rotary, padding tokens. Skipped for impls without it."""
        case = self.default_case(context_lens=(0, 9, 3), query_lens=(7, 1, 1), num_padding_tokens=1, fused_qkv=True)
        self.check_supported(case)
        if getattr(self.backend.get_impl(self.layer_config(case)), "write_kv_rope", None) is None:
            pytest.skip(f"{self.backend.name} does not fuse the rope into its cache write")
        from keel.layers.rotary import RotaryEmbedding

        gen = torch.Generator().manual_seed(self.seed + 75)
        step, num_blocks, prior = make_step(case, gen, self.dtype, self.device)
        with torch.device(self.device):
            rope = RotaryEmbedding(case.head_size, case.head_size // 2, 64, {"rope_type": "default",
                                                                             "rope_theta": 10000.0})
        positions = torch.randint(0, 64, (step.q.shape[0],), generator=gen).to(self.device)
        metadata = self.backend.get_metadata_builder(torch.device(self.device)).build(step.common)
        t = step.q.shape[0]
        q_rot, k_rot = rope(positions, step.q.reshape(t, -1), step.k.reshape(t, -1))
        caches, outs = [], []
        for fused in (False, True):
            cache = self.new_cache(case, num_blocks)
            self.write_cache(cache, *prior)
            impl = self.backend.get_impl(self.layer_config(case))
            if fused:
                q_before, k_before = step.q.clone(), step.k.clone()
                q = impl.write_kv_rope(step.q, step.k, step.v, positions, rope.cos_cache, rope.sin_cache,
                                       rope.rotary_dim, cache, metadata)
                assert torch.equal(step.q, q_before) and torch.equal(step.k, k_before), (
                    f"{case}: write_kv_rope changed its inputs (custom ops are out of place)")
                out = impl.forward(q, step.k, step.v, cache, metadata, kv_written=True)
            else:
                out = impl.forward(q_rot.view_as(step.q), k_rot.view_as(step.k), step.v, cache, metadata)
            caches.append(cache)
            outs.append(out[: step.num_actual_tokens])
        atol, rtol = self.tolerances()
        torch.testing.assert_close(caches[1], caches[0], atol=atol, rtol=rtol, equal_nan=True,
                                   msg=lambda m: f"{case}: the fused rope's cache differs. {m}")
        torch.testing.assert_close(outs[1], outs[0], atol=atol, rtol=rtol,
                                   msg=lambda m: f"{case}: the fused rope's output differs. {m}")

    def test_metadata_shared_across_layers(self) -> None:
        """One builder output serves every layer of the step (different heads, own caches)."""
        cases = [self.default_case(num_heads=4, num_kv_heads=kv, context_lens=(5, 0), query_lens=(1, 6))
                 for kv in (4, 1)]
        steps = []
        for case in cases:
            self.check_supported(case)
            # Same seed: the block table is drawn first, so both layers see the same table and slots.
            gen = torch.Generator().manual_seed(self.seed + 70)
            step, num_blocks, prior = make_step(case, gen, self.dtype, self.device)
            cache = self.new_cache(case, num_blocks)
            self.write_cache(cache, *prior)
            steps.append((case, step, cache))
        metadata = self.backend.get_metadata_builder(torch.device(self.device)).build(steps[0][1].common)
        for case, step, cache in steps:
            out = self.backend.get_impl(self.layer_config(case)).forward(step.q, step.k, step.v, cache, metadata)
            self.check_output(case, step, out)

    def test_multi_step_generation(self) -> None:
        """Chunked prefill then decode steps on one cache, as the runner drives it; every step checked."""
        case = self.default_case(num_kv_heads=2)
        self.check_supported(case)
        gen = torch.Generator().manual_seed(self.seed + 80)
        steps, num_blocks = make_generation(case, gen, self.dtype, self.device, prompt_lens=(19, 4), chunk=8,
                                            decode_steps=4)
        cache = self.new_cache(case, num_blocks)
        impl = self.backend.get_impl(self.layer_config(case))
        for step_case, step in steps:
            self.run_step(step_case, step, cache, impl)


def _poison_allocator(like: torch.Tensor, device: str) -> None:
    """Fill and free memory so that a backend reading an uninitialized buffer likely sees NaN."""
    junk = [torch.full((like.numel() * 4 + 4096,), float("nan"), dtype=like.dtype, device=device)
            for _ in range(4)]
    del junk  # freed at once (refcount); the allocator may hand these pages to the backend next
