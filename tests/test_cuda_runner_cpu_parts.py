"""CPU-checkable parts of the CUDA work: load_format="dummy", the profiling forward, graph buckets, and
uniform (speculative verify) steps through the graph runner's static buffers with the Triton kernels."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

from keel import SamplingParams
from keel.attention.backend import AttentionLayerConfig
from keel.attention.metadata import CommonAttentionMetadata
from keel.config import ConfigError, EngineArgs, ModelConfig
from keel.engine.llm_engine import LLMEngine
from keel.forward_context import ForwardContext
from keel.platform import Platform
from keel.testing.attention import AttentionCase, make_step
from keel.testing.checkpoints import tiny_config
from keel.testing.fidelity import greedy_tokens_and_logprobs
from keel.testing.reference import ref_varlen_attention
from keel.worker.cuda_graph import DecodeGraphRunner, graph_query_lens

# The Triton kernels below run through the interpreter on the CPU; it must be on before the plugin's
# kernel modules are first imported (they are imported inside the tests).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Kernel tests on CPU tensors need the interpreter; on a GPU machine tests/test_cuda_spec_graphs.py runs the
# same steps captured on the device.
interpreted_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the Triton "
                                      "interpreter; tests/test_cuda_spec_graphs.py covers the GPU")


def _config_only(path):
    config = tiny_config("llama")
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)  # config.json, no weights at all


def test_load_format_validated():
    with pytest.raises(ConfigError, match="load_format"):
        ModelConfig(model="x", load_format="npz")


def test_dummy_weights_need_only_a_config(tmp_path):
    _config_only(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", load_format="dummy", max_model_len=64,
        platform="cpu"))
    model = engine.core.worker.runner.model
    params = dict(model.named_parameters())
    assert torch.all(params["model.norm.weight"] == 1.0)
    w = params["model.layers.0.mlp.down_proj.weight"]
    assert 0.5 < float(w.detach().std() * w.shape[1] ** 0.5) < 1.5 and torch.isfinite(w).all()
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert len(outs[0].outputs[0].token_ids) == 3
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_profile_run_returns_temporary_cache_bytes(tmp_path):
    _config_only(tmp_path)
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", load_format="dummy", max_model_len=64,
        platform="cpu"))
    runner = engine.core.worker.runner
    temp = runner.profile_run(num_tokens=150, max_num_seqs=8, max_model_len=64)  # requests 64 + 64 + 22
    blocks = 4 + 4 + 2 + 1  # block size 16, plus the null block
    assert temp == blocks * runner.kv_cache_bytes_per_block()


def test_warm_up_runs_every_power_of_two_step_size_on_device_platforms_only(tmp_path, monkeypatch):
    _config_only(tmp_path)
    # Pinned: unpinned, a GPU machine auto-selects cuda, whose warm-up then runs where the CPU's must not.
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", load_format="dummy", max_model_len=64,
        max_num_batched_tokens=100, platform="cpu"))
    worker = engine.core.worker
    runs = []
    real_profile_run = worker.runner.profile_run
    monkeypatch.setattr(worker.runner, "profile_run",
                        lambda n, seqs, length, decode_seq_lens=(): runs.append((n, seqs, length, tuple(decode_seq_lens))))
    worker.warm_up()
    assert runs == []  # the CPU compiles nothing worth a warm-up
    assert worker.runner.warm_up(100, 8, 64) == [1, 2, 4, 8, 16, 32, 64, 100]
    prefills = [(n, 8, 64, ()) for n in (1, 2, 4, 8, 16, 32, 64, 100)]
    # then a decode of each power-of-two context (split-K counts follow it), alone and in a mixed step
    decodes = [(n, 8, 64, (s,)) for s in (1, 2, 4, 8, 16, 32, 64) for n in (0, 16)]
    assert runs == prefills + decodes
    assert not worker.platform.use_startup_warm_up()
    monkeypatch.setattr(worker.platform, "use_startup_warm_up", lambda: True)  # any device platform
    runs.clear()
    worker.warm_up()
    assert [n for n, _, _, d in runs if not d] == [1, 2, 4, 8, 16, 32, 64, 100]
    # the dummy decode and mixed steps run for real (here on the CPU model)
    real_profile_run(0, 8, 64, decode_seq_lens=[64])
    real_profile_run(16, 8, 64, decode_seq_lens=[33, 1])
    # past 512 tokens also one and five short of each power of two (Triton's variants of M, and of M padded to 4)
    runs.clear()
    assert worker.runner.warm_up(2048, 8, 64) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1019, 1023, 1024,
                                                  2043, 2047, 2048]


def test_warm_up_runs_the_samplers_compiled_noise_for_one_row_and_for_max_num_seqs(tmp_path, monkeypatch):
    """The random rows' noise compiles at startup (before the heap freeze), not in the first sampled step."""
    from keel.layers import sampler as sampler_mod

    _config_only(tmp_path)
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", load_format="dummy", max_model_len=64,
        max_num_batched_tokens=64, platform="cpu"))
    runner = engine.core.worker.runner
    calls = []

    def noise_for(device):
        def noise(seeds, step, vocab):
            calls.append((seeds.shape[0], step.shape[0], vocab, device.type))
            return sampler_mod.log_exponential_noise(seeds, step, vocab)
        return noise
    monkeypatch.setattr(sampler_mod, "_noise_for", noise_for)
    monkeypatch.setattr(runner, "profile_run", lambda *a, **k: None)
    vocab = json.loads((tmp_path / "config.json").read_text())["vocab_size"]
    runner._profiled_vocab = vocab  # the logits' width the real profile_run records
    runner.warm_up(64, 8, 64)
    assert calls == [(1, 1, vocab, "cpu"), (8, 8, vocab, "cpu")]
    calls.clear()
    runner.sampler.warm_up(vocab, 1, torch.device("cpu"))
    assert calls == [(1, 1, vocab, "cpu"), (2, 2, vocab, "cpu")]


def test_sampling_after_the_samplers_warm_up_compiles_nothing(tmp_path, monkeypatch):
    """The warm-up's compiled noise is the variant the sampling step takes (same guards: inference mode,
    seeds and step distinct, sizes 1 and many): sampled steps after it add no graph. The CPU samples
    eagerly, so the noise is compiled here with dynamo's eager backend, which guards as inductor does."""
    from torch._dynamo.utils import counters

    from keel.layers import sampler as sampler_mod

    torch._dynamo.reset()
    compiled = torch.compile(sampler_mod.log_exponential_noise, dynamic=True, fullgraph=True, backend="eager")
    monkeypatch.setattr(sampler_mod, "_noise_for", lambda device: compiled)
    _config_only(tmp_path)
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", load_format="dummy", max_model_len=64,
        max_num_batched_tokens=64, max_num_seqs=8, platform="cpu", async_scheduling=True))
    runner = engine.core.worker.runner
    counters.clear()
    try:
        runner.sampler.warm_up(json.loads((tmp_path / "config.json").read_text())["vocab_size"], 8, runner.device)
        warmed = counters["stats"]["unique_graphs"]
        assert warmed == 2  # one row; two or more
        for n in (1, 3, 8):  # batches of sampled rows
            for i in range(n):
                engine.add_request(f"r{n}-{i}", {"prompt_token_ids": [1 + i, 2, 3]},
                                   SamplingParams(temperature=1.0, max_tokens=4, seed=i, ignore_eos=True))
            while engine.has_unfinished_requests():
                engine.step()
        assert counters["stats"]["unique_graphs"] == warmed
    finally:
        torch._dynamo.reset()


def test_platform_base_memory_queries_default_to_unknown():
    p = Platform()
    p.reset_peak_memory_stats()
    assert p.peak_memory_allocated() is None and p.memory_allocated() is None


def test_graph_runner_buckets_and_declines_non_decode_steps():
    g = DecodeGraphRunner(torch.nn.Identity(), [], [], [], torch.device("cpu"), 16, [8, 1, 4, 2], 100)
    assert g.sizes == [1, 2, 4, 8] and g.block_table.shape == (8, 16)  # 7 blocks, padded to 16 columns
    assert [g.bucket(n) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, None]

    class Step:
        num_reqs, max_query_len, num_actual_tokens = 2, 3, 6
        block_table = torch.zeros(2, 3)

    assert g.run(torch.zeros(6), torch.zeros(6), Step()) is None  # a prefill never replays


# ---------------------------------------------------------------- uniform (speculative verify) graphs
# The capture itself needs CUDA; everything around it runs here: the runner stages a step into its
# static buffers and "replays" by running the forward eagerly with the context built once at capture
# time, so metadata that depended on one step's lengths would be caught on the next step.

DEV = torch.device("cpu")


class EagerReplay(DecodeGraphRunner):
    """A DecodeGraphRunner whose "graphs" are the capture-time forward contexts, run eagerly on the
    static buffers (what a CUDA graph replays, minus the capture)."""

    def capture(self) -> None:
        for q, b in self.keys:
            self.graphs[(q, b)] = (None, self._context(b, q))

    def _replay(self, key):
        q, b = key
        self.last_out = self.model(self.input_ids[: b * q], self.positions[: b * q], self.graphs[key][1])
        return self.last_out


class TableModel(torch.nn.Module):
    """One attention layer whose impl inputs (q/k/v; MLA: q_nope/q_pe/kv_c/k_pe) are rows looked up by
    token id (the last row is NaN: poison)."""

    def __init__(self, impl, *tables) -> None:
        super().__init__()
        self.impl, self.tables = impl, tables

    def forward(self, input_ids, positions, ctx: ForwardContext):
        return self.impl.forward(*(t[input_ids] for t in self.tables), ctx.kv_caches[0], ctx.attn_metadata[0])


def test_graph_query_lens_follows_every_backend():
    class Wide:
        name, cuda_graph_max_query_len = "wide", 8

    class Narrow:
        name = "narrow"  # no attribute: decode only

    assert graph_query_lens([Wide], 0) == (1,)
    assert graph_query_lens([Wide], 3) == (1, 4)
    assert graph_query_lens([Wide], 8) == (1,)  # 9 tokens per request is past its limit
    assert graph_query_lens([Wide, Narrow], 3) == (1,)
    with pytest.raises(ValueError, match="query_lens"):
        DecodeGraphRunner(torch.nn.Identity(), [], [], [], DEV, 16, [1], 64, query_lens=(0, 2))


def test_graph_runner_sizes_buffers_for_the_longest_query():
    g = DecodeGraphRunner(torch.nn.Identity(), [], [], [], DEV, 16, [2, 8], 100, query_lens=(4, 1))
    assert g.query_lens == [1, 4] and g.input_ids.shape == (32,) and g.slot_mapping.shape == (32,)
    assert g.seq_lens.shape == (8,) and g.query_start_locs[4].tolist() == [0, 4, 8, 12, 16, 20, 24, 28, 32]
    assert g.keys[0] == (4, 8) and len(g.keys) == 4  # most tokens first: its pool serves the rest


CACHE_BLOCKS = 40  # every step of a test shares one cache tensor, like the runner's


def _flash_step(case: AttentionCase, seed: int):
    """A random step, a NaN-poisoned cache of CACHE_BLOCKS blocks holding its earlier context, and the
    step's q/k/v as lookup tables (one extra NaN row: the poison padding rows read)."""
    gen = torch.Generator().manual_seed(seed)
    step, num_blocks, (slots, k, v) = make_step(case, gen, torch.float32, "cpu")
    assert num_blocks <= CACHE_BLOCKS
    cache = torch.full((2, CACHE_BLOCKS, case.block_size, case.num_kv_heads, case.head_size), float("nan"))
    flat = cache.view(2, -1, case.num_kv_heads, case.head_size)
    flat[0, slots], flat[1, slots] = k, v
    tables = [torch.cat([x, torch.full((1, *x.shape[1:]), float("nan"))]) for x in (step.q, step.k, step.v)]
    return step, cache, tables


def _flash_impl(case: AttentionCase, splits: int | None):
    from keel_attention_flash.impl import TritonFlashAttentionImpl

    layer = AttentionLayerConfig(case.num_heads, case.num_kv_heads, case.head_size, 1 / math.sqrt(case.head_size),
                                 torch.float32, case.block_size, sliding_window=case.sliding_window)
    return TritonFlashAttentionImpl(layer, decode_splits=splits)


@pytest.mark.parametrize("case,splits", [
    (AttentionCase(context_lens=(37, 0, 70), query_lens=(3, 3, 3), num_heads=6, num_kv_heads=2, head_size=64,
                   block_size=16), None),
    (AttentionCase(context_lens=(90, 5, 33), query_lens=(4, 4, 4), num_heads=4, num_kv_heads=1, head_size=64,
                   block_size=32, sliding_window=40), 3),
])
@interpreted_only
def test_flash_uniform_verify_step_through_the_runner(case, splits):
    """A uniform q-token step staged into the runner's buffers (one padding request: seq_len 0, slots -1,
    NaN q/k/v rows) gives the eager varlen kernel's output and the dense reference, and writes the cache
    exactly as the eager step does; a second step through the same graph context gets its own answer."""
    from keel_attention_flash.backend import TritonFlashAttentionBackend

    q = case.query_lens[0]
    scale = 1 / math.sqrt(case.head_size)
    impl = _flash_impl(case, splits)
    builder = TritonFlashAttentionBackend.get_metadata_builder(DEV)
    step, cache, tables = _flash_step(case, seed=q)
    t = step.num_actual_tokens
    eager_cache = cache.clone()
    md = builder.build(step.common)
    assert md.is_decode and md.query_len == q  # the eager step takes the same split-K path
    varlen = impl.forward(step.q, step.k, step.v, eager_cache, dataclasses.replace(md, is_decode=False))

    model = TableModel(impl, *tables)
    g = EagerReplay(model, [builder], [0], [cache], DEV, case.block_size, [2, 4], 256, query_lens=(1, q))
    g.input_ids.fill_(t)  # padding rows read the NaN row
    g.capture()
    ids = torch.arange(t)
    hidden = g.run(ids, ids, step.common)
    assert hidden is not None and hidden.shape[0] == t and g.replays_by_query_len == {1: 0, q: 1}
    ref = ref_varlen_attention(step.q[:t], step.keys, step.values, list(case.query_lens), scale=scale,
                               sliding_window=case.sliding_window)
    torch.testing.assert_close(hidden.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, varlen[:t], atol=1e-5, rtol=1e-5)
    assert g.seq_lens[3:4].tolist() == [0] and g.slot_mapping[t : 4 * q].eq(-1).all()
    assert g.last_out.shape[0] == 4 * q and torch.isfinite(g.last_out).all()  # NaN padding rows stay inside
    torch.testing.assert_close(cache, eager_cache, equal_nan=True, atol=0, rtol=0)

    # Same graph, another step with other lengths (and 2 padding requests).
    case2 = dataclasses.replace(case, context_lens=(61, 2), query_lens=(q, q))
    step2, cache2, tables2 = _flash_step(case2, seed=q + 10)
    cache.copy_(cache2)
    model.tables = tables2
    g.input_ids[2 * q :].fill_(2 * q)
    hidden2 = g.run(torch.arange(2 * q), torch.arange(2 * q), step2.common)
    ref2 = ref_varlen_attention(step2.q[: 2 * q], step2.keys, step2.values, [q, q], scale=scale,
                                sliding_window=case.sliding_window)
    torch.testing.assert_close(hidden2.double(), ref2, atol=1e-5, rtol=1e-5)
    assert g.replays_by_query_len[q] == 2 and g.num_replays == 2


def test_non_uniform_or_uncaptured_steps_run_eagerly():
    g = EagerReplay(torch.nn.Identity(), [], [], [], DEV, 16, [2, 4], 64, query_lens=(1, 3))
    g.capture = lambda: g.graphs.update({k: (None, None) for k in g.keys})  # no builders: keys only
    g.capture()

    def common(query_lens, width=2):
        qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        n = len(query_lens)
        return CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.full((n,), 9, dtype=torch.int32),
            seq_lens_cpu=torch.full((n,), 9, dtype=torch.int32), block_table=torch.zeros(n, width, dtype=torch.int32),
            slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64), num_reqs=n, num_actual_tokens=int(qsl[-1]),
            max_query_len=max(query_lens), max_seq_len=9, block_size=16)

    assert g.graph_key(9, common([3, 3, 3])) == (3, 4)
    assert g.graph_key(2, common([1, 1])) == (1, 2)
    assert g.graph_key(8, common([3, 2, 3])) is None  # one request drafted fewer tokens
    assert g.graph_key(7, common([3, 1, 3])) is None
    assert g.graph_key(4, common([2, 2])) is None  # q = 2 was not captured
    assert g.graph_key(15, common([3] * 5)) is None  # more requests than the largest bucket
    assert g.graph_key(6, common([3, 3], width=17)) is None  # wider than the captured (padded) table
    assert g.run(torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64), common([3, 2, 3])) is None
    assert g.num_replays == 0


# MLA dimensions: heads, nope, rope, v, latent.
MH, MN, MR, MV, ML = 4, 16, 8, 16, 32


def _mla_step(context_lens, q, bs, gen):
    """Uniform MLA step: (common, cache of CACHE_BLOCKS blocks, NaN outside the context, q_nope/q_pe/kv_c/k_pe
    tables with a trailing NaN row)."""
    totals = [c + q for c in context_lens]
    blocks = [-(-t // bs) for t in totals]
    perm = (torch.randperm(CACHE_BLOCKS - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(totals), max(blocks) + 1, dtype=torch.int32)
    for i, nb in enumerate(blocks):
        table[i, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
    cache = torch.full((CACHE_BLOCKS, bs, ML + MR), float("nan"))
    new, slots = [], []
    for i, (c, total) in enumerate(zip(context_lens, totals)):
        lat = torch.randn(total, ML + MR, generator=gen)
        for p in range(total):
            slot = int(table[i, p // bs]) * bs + p % bs
            if p < c:
                cache.view(-1, ML + MR)[slot] = lat[p]
            else:
                new.append(lat[p])
                slots.append(slot)
    n = len(context_lens)
    qsl = torch.arange(n + 1, dtype=torch.int32) * q
    seq = torch.tensor(totals, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, seq_lens_cpu=seq, block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), num_reqs=n, num_actual_tokens=n * q,
        max_query_len=q, max_seq_len=max(totals), block_size=bs)
    lat = torch.stack(new + [torch.full((ML + MR,), float("nan"))])
    qt = torch.cat([torch.randn(n * q, MH, MN + MR, generator=gen), torch.full((1, MH, MN + MR), float("nan"))])
    return common, cache, (qt[..., :MN], qt[..., MN:], lat[:, :ML], lat[:, ML:])


@pytest.mark.parametrize("q,splits", [(2, None), (4, 3)])
@interpreted_only
def test_mla_uniform_verify_step_through_the_runner(q, splits):
    """triton_mla: a uniform verify step runs the absorbed split-K kernel with q rows per request (no
    prefill tiles); staged through the runner with a padding request it equals the eager query-tile
    path, and writes the cache exactly as it does."""
    from keel_attention_flash.mla_backend import TritonMLABackend
    from keel_attention_flash.mla_impl import TritonMLAImpl

    bs = 8
    gen = torch.Generator().manual_seed(q)
    layer = AttentionLayerConfig(MH, 1, ML + MR, (MN + MR) ** -0.5, torch.float32, bs, use_mla=True, extra=(
        ("kv_lora_rank", ML), ("qk_nope_head_dim", MN), ("qk_rope_head_dim", MR), ("v_head_dim", MV)))
    impl = TritonMLAImpl(layer, decode_splits=splits)
    impl.process_weights_after_loading(torch.randn(MH, MN, ML, generator=gen) / ML**0.5,
                                       torch.randn(MH, MV, ML, generator=gen) / ML**0.5)
    builder = TritonMLABackend.get_metadata_builder(DEV)
    common, cache, tables = _mla_step((21, 0, 40), q, bs, gen)
    t = common.num_actual_tokens
    md = builder.build(common)
    assert md.is_decode and md.query_len == q and not md.prefill_reqs
    tiles = dataclasses.replace(md, decode_reqs=torch.empty(0, dtype=torch.int32), num_decodes=0,
                                prefill_reqs=[0, 1, 2], query_len=1)
    eager_cache = cache.clone()
    eager = impl.forward(*(x[:t] for x in tables), eager_cache, tiles)

    g = EagerReplay(TableModel(impl, *tables), [builder], [0], [cache], DEV, bs, [4], 128, query_lens=(1, q))
    g.input_ids.fill_(t)  # padding rows read the NaN row
    g.capture()
    hidden = g.run(torch.arange(t), torch.arange(t), common)
    assert hidden is not None and hidden.shape == (t, MH, MV) and g.replays_by_query_len[q] == 1
    assert g.last_out.shape[0] == 4 * q and torch.isfinite(g.last_out).all()  # NaN padding rows stay inside
    torch.testing.assert_close(hidden, eager, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(cache, eager_cache, equal_nan=True, atol=0, rtol=0)


def make_cycle_checkpoint(path, arch: str = "llama", **kw):
    """A tiny random checkpoint whose greedy continuation walks cycles of 6 tokens (x -> x + 1 within
    each block of 6): blocks' outputs are damped to a tenth and lm_head row sigma(x) is x's embedding.
    So n-gram drafts become full and accepted after one cycle -- every request then verifies the same
    number of drafts (uniform steps) -- while attention still moves the logits (compare logprobs)."""
    from safetensors.torch import load_file, save_file

    from keel.testing.checkpoints import make_checkpoint

    make_checkpoint(arch, path, **kw)
    file = next(path.glob("*.safetensors"))
    w = load_file(str(file))
    for name in list(w):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = w[name] * 0.1
    w["model.norm.weight"] = torch.ones_like(w["model.norm.weight"])
    emb = w["model.embed_tokens.weight"]
    x = torch.arange(emb.shape[0])
    # A tenth: logits of a few units, so logprobs are far from 0 and show attention's contribution.
    w["lm_head.weight"] = torch.empty_like(emb).index_copy_(0, (x // 6) * 6 + (x + 1) % 6, emb * 0.1)
    save_file(w, str(file), metadata={"format": "pt"})
    return path


def _spec_engine(path, spec: bool) -> LLMEngine:
    args = {"model": str(path), "skip_tokenizer_init": True, "dtype": "float32", "block_size": 16,
            "max_model_len": 64, "plugins": ["platform-cpu", "attention-flash", "models-llama"],
            "attention_backend": "triton_flash"}
    if spec:
        args["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3,
                                      "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    return LLMEngine.from_engine_args(EngineArgs(**args))


def _greedy(engine: LLMEngine, prompts, n: int) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and their logprobs per prompt."""
    return greedy_tokens_and_logprobs(engine, prompts, n)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda_spec_graphs.py covers this captured")
def test_ngram_engine_through_the_graph_runner_equals_non_speculative(tmp_path):
    """What ModelRunner.capture_cuda_graphs sets up with query_lens=graph_query_lens(...), minus the
    capture: ngram verify steps (4 tokens per request) replay through the runner's static buffers and
    the greedy tokens equal non-speculative decoding."""
    path = make_cycle_checkpoint(tmp_path / "m", head_dim=64, num_hidden_layers=1, vocab_size=24)
    # Prompts holding a whole cycle: full drafts from the first decode step on.
    prompts = [[0, 1, 2, 3, 4, 5, 0, 1], [6, 7, 8, 9, 10, 11, 6], [15, 16, 17, 12, 13, 14, 15, 16, 17]]
    base, base_lp = _greedy(_spec_engine(path, spec=False), prompts, 14)
    engine = _spec_engine(path, spec=True)
    runner = engine.core.worker.runner
    query_lens = graph_query_lens({layer.backend for layer in runner.attn_layers}, runner.num_speculative_tokens)
    assert query_lens == (1, 4)
    runner.cuda_graphs = EagerReplay(runner.model, runner._builders, runner._layer_builder, runner.kv_caches,
                                     runner.device, runner.block_size, [1, 2, 4], 64, query_lens=query_lens)
    runner.cuda_graphs.capture()
    tokens, lp = _greedy(engine, prompts, 14)
    assert tokens == base
    torch.testing.assert_close(torch.tensor(lp), torch.tensor(base_lp), atol=1e-4, rtol=0)
    assert runner.cuda_graphs.replays_by_query_len[4] > 0


class _Capturer:
    """A stand-in capturer (GraphCaptureSpec.capturer names it): records the batch sizes it was given."""

    sizes: list = []

    def __init__(self, model, builders, layer_builder, kv_caches, device, block_size, sizes, max_model_len):
        _Capturer.sizes = list(sizes)

    def capture(self):
        pass


def _capture(max_num_seqs, batch_sizes, caplog):
    import types

    from keel.platform import GraphCaptureSpec
    from keel.worker.model_runner import ModelRunner

    runner = types.SimpleNamespace(pipeline=None, dp_lockstep=False, attn_layers=[], model=None, _builders=None,
                                   _layer_builder=None, kv_caches=[], device="cpu", block_size=16,
                                   num_speculative_tokens=0, proposer=None)
    spec = GraphCaptureSpec(supported=True, batch_sizes=batch_sizes, capturer=f"{__name__}:_Capturer")
    with caplog.at_level("WARNING", logger="keel.worker"):
        assert ModelRunner.capture_cuda_graphs(runner, spec, max_num_seqs, 64)
    return _Capturer.sizes


def test_graphs_cover_max_num_seqs_or_say_where_they_stop(caplog):
    """The buckets up to max_num_seqs are captured (to 1024 on CUDA); decode steps above the largest run eagerly,
    and startup says which (a throughput cliff under load is not left to be found in a profile)."""
    from keel_platform_cuda.platform import CAPTURE_SIZES

    for seqs in (1, 256, 512, 1024):  # the harness's 256, and vLLM's largest default bucket and past it
        assert _capture(seqs, CAPTURE_SIZES, caplog)[-1] == seqs and not caplog.records
    assert _capture(250, CAPTURE_SIZES, caplog)[-1] == 240
    assert "decode steps of 241-250 requests run eagerly" in caplog.text
    caplog.clear()
    assert _capture(2048, CAPTURE_SIZES, caplog)[-1] == 1024
    assert "1025-2048 requests run eagerly" in caplog.text
