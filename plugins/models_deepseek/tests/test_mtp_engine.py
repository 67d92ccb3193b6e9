"""MTP speculative decoding for DeepSeek-V3 checkpoints through keel's engine on the CPU.

The checkpoint is a tiny random V3 whose attention/MLP outputs are scaled down (the model is close to
a bigram model), with an MTP module written into its safetensors: the last decoder layer copied,
eh_proj mostly passing the token embedding, shared_head tied to the target's norm and lm_head. Its
drafts are therefore often, not always, accepted. Outputs must equal non-speculative decoding
(greedy, seeded random) and transformers' greedy; the sampled distribution must be the target's.
"""

from __future__ import annotations

import math

import pytest
import torch
from deepseek_test_utils import NUM_LAYERS, VOCAB, make_mtp_checkpoint, random_prompts

from keel import SamplingParams
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "v3")


def make_engine(path, k: int | None, **kw) -> LLMEngine:
    args = {"model": str(path), "skip_tokenizer_init": True, "dtype": "float32", "block_size": 4,
            "max_model_len": 96, "seed": 0, **kw}
    if k:
        args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
    return LLMEngine.from_engine_args(EngineArgs(**args))


def run(engine, prompts, params):
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [done[str(i)] for i in range(len(prompts))]


def assert_same(a_outs, b_outs, logprobs: bool = True):
    for a, b in zip(a_outs, b_outs):
        assert a.token_ids == b.token_ids
        if logprobs:
            for da, db in zip(a.logprobs, b.logprobs):
                t = next(iter(db))
                assert abs(da[t].logprob - db[t].logprob) < 1e-4


def assert_counters(engine, min_accepted: int = 1):
    m = engine.get_metrics()
    assert m["spec_decode_num_draft_tokens_total"] > 0
    assert min_accepted <= m["spec_decode_num_accepted_tokens_total"] <= m["spec_decode_num_draft_tokens_total"]
    assert m["kv_cache_usage"] == 0.0
    return m


@torch.no_grad()
def hf_greedy(path, prompts, max_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    outs = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        outs.append(ids[len(prompt):])
    return outs


PROMPTS = random_prompts([5, 17, 9, 30], seed=11)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)


_BASE: dict = {}


@pytest.fixture
def greedy_base(ckpt):
    # Function-scoped, cached: engines run only inside tests, after conftest's autouse TRITON_INTERPRET=0
    # (a module-scoped fixture would run before it, under another plugin's session-wide setting).
    if str(ckpt) not in _BASE:
        _BASE[str(ckpt)] = run(make_engine(ckpt, None), PROMPTS, GREEDY)
    return _BASE[str(ckpt)]


def test_non_speculative_engine_matches_transformers(ckpt, greedy_base):
    assert [o.token_ids for o in greedy_base] == hf_greedy(ckpt, PROMPTS, GREEDY.max_tokens)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_identical_to_non_speculative(ckpt, greedy_base, k):
    engine = make_engine(ckpt, k)
    assert {layer.backend.name for layer in engine.core.worker.runner.attn_layers} == {"torch_mla"}
    assert len(engine.core.worker.runner.attn_layers) == NUM_LAYERS + 1  # the MTP layer has its own cache
    assert_same(greedy_base, run(engine, PROMPTS, GREEDY))
    m = assert_counters(engine, min_accepted=4)
    if k == 3:  # recursive drafts are proposed, and some of them accepted
        assert m["spec_decode_num_draft_tokens_total"] > 2 * m["spec_decode_num_accepted_tokens_total"] / 3


def test_chunked_prefill_fills_the_mtp_cache(ckpt, greedy_base):
    # Prefill chunks that sample nothing still run the MTP layer: drafts after a chunked prefill
    # equal those after a one-shot prefill.
    def drafts_after_prefill(**kw):
        engine = make_engine(ckpt, 3, **kw)
        proposer = engine.core.worker.runner.proposer
        seen, real = {}, proposer.propose_on_device

        def spy(batch):
            out = real(batch)
            for i in batch.drafting.tolist():
                if batch.req_ids[i] not in seen:
                    seen[batch.req_ids[i]] = out[i].tolist()
            return out

        proposer.propose_on_device = spy
        outs = run(engine, PROMPTS, GREEDY)
        return seen, outs

    one_shot, _ = drafts_after_prefill()
    chunked, outs = drafts_after_prefill(max_num_batched_tokens=6)
    assert chunked == one_shot and len(chunked) == len(PROMPTS)
    assert_same(greedy_base, outs)


def test_seeded_random_identical_to_non_speculative(ckpt):
    params = [SamplingParams(temperature=t, seed=s, max_tokens=14, ignore_eos=True, logprobs=0, top_k=tk,
                             repetition_penalty=rp)
              for s, (t, tk, rp) in enumerate([(1.0, -1, 1.0), (0.5, -1, 1.0), (0.7, 8, 1.2), (0.3, -1, 1.0)])]
    base = run(make_engine(ckpt, None), PROMPTS, params)
    engine = make_engine(ckpt, 3)
    assert_same(base, run(engine, PROMPTS, params))
    assert_counters(engine)


@torch.no_grad()
def test_sampled_distribution_is_the_targets(ckpt):
    """The second output token (the first one verified against a draft) over many seeds follows
    p(t2) = sum_t1 p(t1) p(t2 | t1) computed by transformers (chi-square, p < 1e-4 to fail)."""
    from transformers import AutoModelForCausalLM

    temperature, n = 0.5, 300
    prompt = random_prompts([6], seed=12)[0]
    engine = make_engine(ckpt, 2)
    params = [SamplingParams(temperature=temperature, seed=1000 + s, max_tokens=3, ignore_eos=True)
              for s in range(n)]
    outs = run(engine, [prompt] * n, params)
    assert engine.get_metrics()["spec_decode_num_draft_tokens_total"] >= n
    counts = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=VOCAB).double()

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    p1 = (model(torch.tensor([prompt])).logits[0, -1] / temperature).softmax(-1).double()  # [V]
    seqs = torch.cat((torch.tensor([prompt]).expand(VOCAB, -1), torch.arange(VOCAB)[:, None]), dim=1)
    p2 = (model(seqs).logits[:, -1] / temperature).softmax(-1).double()  # [V, V]: row t1
    expected = (p1[:, None] * p2).sum(0) * n  # [V]
    big = expected >= 5
    obs = torch.cat((counts[big], counts[~big].sum()[None]))
    exp = torch.cat((expected[big], expected[~big].sum()[None]))
    keep = exp > 0
    chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    assert df >= 3  # the distribution is spread enough for the check to mean something
    z = 3.72  # one-sided p = 1e-4, Wilson-Hilferty approximation of the chi-square quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < critical, (chi2, critical, df)


def test_preemption_with_drafts_in_flight(ckpt):
    prompts = random_prompts([10, 14, 9, 12, 11, 13], seed=13)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=0)
    engine = make_engine(ckpt, 3, num_kv_blocks=18, max_model_len=40)
    spec = run(engine, prompts, params)
    assert engine.get_metrics()["num_preemptions_total"] > 0
    assert_counters(engine)
    assert_same(run(make_engine(ckpt, None, max_model_len=40), prompts, params), spec)


def test_prefix_cache_follow_up_matches_no_cache_run(ckpt):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True, logprobs=0)
    engine = make_engine(ckpt, 3)
    first = run(engine, PROMPTS[:3], params)
    follow = [PROMPTS[i] + first[i].token_ids[:10] for i in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    hits_before = engine.get_metrics()["prefix_cache_hits_total"]
    cached = run(engine, follow, greedy)
    assert engine.get_metrics()["prefix_cache_hits_total"] > hits_before
    assert_same(run(make_engine(ckpt, None, enable_prefix_caching=False), follow, greedy), cached)
    assert_counters(engine)


def test_checkpoint_without_mtp_is_refused_at_startup(tmp_path):
    from keel_models_deepseek.mtp import MTPConfigError

    plain = make_mtp_checkpoint(tmp_path / "plain", mtp=False, declare=0)
    with pytest.raises(MTPConfigError, match="num_nextn_predict_layers"):
        make_engine(plain, 1)
    declared = make_mtp_checkpoint(tmp_path / "declared", mtp=False, declare=1)
    with pytest.raises(MTPConfigError, match=r"no model\.layers\.2\.\* tensors"):
        make_engine(declared, 1)


def test_mtp_loading_is_strict(tmp_path):
    from keel.models.weights import WeightLoadError

    stray = make_mtp_checkpoint(tmp_path / "stray", extra={"mystery.weight": torch.zeros(3)})
    with pytest.raises(WeightLoadError, match="model.layers.2|mystery"):
        make_engine(stray, 1)
    missing = make_mtp_checkpoint(tmp_path / "missing", drop=("hnorm.weight",))
    with pytest.raises(WeightLoadError, match="hnorm"):
        make_engine(missing, 1)


def test_drafts_stop_at_max_model_len(ckpt):
    # Requests run into max_model_len with drafts in flight: no draft (nor MTP write) past it.
    prompts = random_prompts([17, 20, 9], seed=14)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    engine = make_engine(ckpt, 3, max_model_len=24)
    spec = run(engine, prompts, params)
    assert [len(o.token_ids) for o in spec] == [7, 4, 15]
    assert_same(run(make_engine(ckpt, None, max_model_len=24), prompts, params), spec)
    assert_counters(engine)



def test_dummy_load_format_builds_random_mtp_weights(ckpt):
    # The proposer alone (the engine's DeepSeek target does not serve load_format="dummy" yet).
    from deepseek_test_utils import build_context, load_keel
    from keel_models_deepseek.deepseek_v3 import DeepseekV3ForCausalLM
    from keel_models_deepseek.mtp import DeepSeekMTPProposer

    from keel.spec_decode.proposer import ProposerContext

    target = load_keel(DeepseekV3ForCausalLM, ckpt)
    ctx = ProposerContext("mtp", 2, (), target, torch.device("cpu"), build=build_context(ckpt),
                          model_path=None, load_format="dummy")
    proposer = DeepSeekMTPProposer(ctx)
    (layer,) = proposer.attention_layers()
    assert layer.layer_idx == NUM_LAYERS
    assert all(torch.isfinite(p).all() for p in proposer.layer.parameters())
    assert proposer.layer.eh_proj.weight.abs().sum() > 0 and proposer.layer.embed_tokens.weight.abs().sum() > 0
