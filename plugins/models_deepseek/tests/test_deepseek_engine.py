"""End-to-end fidelity of DeepSeek-V2/V3 through keel's engine on the CPU, against transformers.

Greedy tokens must equal a full-recompute greedy loop in transformers and float32 logprobs must match
within 1e-4 -- for batches, staggered arrivals with chunked prefill, preemption and prefix-cache hits.
`attention_backend` stays "auto": MLA layers must land on torch_mla. MoE runs the torch reference,
and (tiny run) the Triton kernel under TRITON_INTERPRET=1 (conftest defaults it off).
"""

from __future__ import annotations

import pytest
from deepseek_test_utils import DEEPSEEK_YARN, make_deepseek_checkpoint, random_prompts

from keel import SamplingParams
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.testing.fidelity import assert_matches_hf, run_requests

ATOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
CHECKPOINTS = {
    "v2": (2, {"n_shared_experts": 2}),  # fused as experts 8 and 9 (V3: one, expert 8)
    "v3": (3, {"q_lora_rank": 48, "rope_parameters": DEEPSEEK_YARN, "num_hidden_layers": 3,
               "routed_scaling_factor": 2.5}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    return {name: make_deepseek_checkpoint(v, root / name, **kw) for name, (v, kw) in CHECKPOINTS.items()}


def make_engine(path, **kw) -> LLMEngine:
    args = {"model": str(path), "skip_tokenizer_init": True, "dtype": "float32", "block_size": 4,
            "max_model_len": 128, "seed": 0, **kw}
    return LLMEngine.from_engine_args(EngineArgs(**args))


def run(engine, prompts, params, stagger=0):
    return run_requests(engine, prompts, params, stagger=stagger)


def check_against_hf(path, prompts, results, max_tokens):
    assert_matches_hf(path, prompts, results, max_tokens, atol=ATOL)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_batch_submitted_together(checkpoints, name):
    path = checkpoints[name]
    prompts = random_prompts([5, 17, 9, 30], seed=1)
    engine = make_engine(path)
    backends = {layer.backend.name for layer in engine.core.worker.runner.attn_layers}
    assert backends == {"torch_mla"}  # chosen by "auto" because torch_paged declines MLA
    model = engine.core.worker.runner.model
    assert model.shared_experts_fusion.num_fused == {"v2": 2, "v3": 1}[name]  # the fused path is what is checked
    check_against_hf(path, prompts, run(engine, prompts, GREEDY), 8)


def test_staggered_arrivals_and_chunked_prefill(checkpoints):
    path = checkpoints["v3"]
    prompts = random_prompts([23, 4, 41, 12], seed=2)
    results = run(make_engine(path, max_num_batched_tokens=16), prompts, GREEDY, stagger=2)
    check_against_hf(path, prompts, results, 8)


def test_preemption_keeps_outputs(checkpoints):
    path = checkpoints["v2"]
    prompts = random_prompts([10, 14, 9, 12, 11, 13], seed=3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    engine = make_engine(path, num_kv_blocks=16, max_model_len=48)
    results = run(engine, prompts, params)
    assert engine.get_metrics()["num_preemptions_total"] > 0
    check_against_hf(path, prompts, results, 12)


def test_prefix_cache_hits_compute_only_new_tokens(checkpoints):
    path = checkpoints["v3"]
    shared = random_prompts([16], seed=4)[0]
    prompts = [shared + [5, 6, 7], shared + [8, 9]]
    engine = make_engine(path)
    first = run(engine, prompts[:1], GREEDY)
    hits_before = engine.get_metrics()["prefix_cache_hits_total"]
    second = run(engine, prompts[1:], GREEDY)
    assert engine.get_metrics()["prefix_cache_hits_total"] - hits_before == 16
    assert second["0"].num_cached_tokens == 16
    check_against_hf(path, prompts[:1], first, 8)
    check_against_hf(path, prompts[1:], second, 8)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_interpreted_triton_moe_end_to_end(checkpoints, monkeypatch, name):
    """kernels-triton's MoE ops bound as on CUDA (the CPU platform forced to bind custom ops)."""
    # On before kernels-triton's elementwise kernels are first imported (jitted at import): run alone,
    # this test is the first to import them.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from keel_kernels_triton.fused_moe.ops import TritonFusedExperts, TritonRouterGemm, TritonSelectExperts
    from keel_kernels_triton.ops import TritonMLARope
    from keel_platform_cpu.platform import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "use_custom_ops", lambda self: True)
    path = checkpoints[name]
    prompts = random_prompts([6, 3], seed=5)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0)
    engine = make_engine(path, max_num_batched_tokens=4,  # chunked too
                         plugins=["platform-cpu", "attention-torch", "models-deepseek", "kernels-triton"])
    moe = [m for m in engine.core.worker.runner.model.modules() if hasattr(m, "w13_weight")]
    assert moe and all(isinstance(m.bound_ops.get("fused_experts"), TritonFusedExperts) for m in moe)
    assert all(isinstance(m.bound_ops.get("select_experts"), TritonSelectExperts) for m in moe)
    gates = [m for m in engine.core.worker.runner.model.modules() if type(m).__name__ == "MoEGate"]
    assert gates and all(isinstance(m.bound_ops.get("router_gemm"), TritonRouterGemm) for m in gates)
    # MLA's q / k rope runs the fused kernel too (q_nope handed on as a view, nothing concatenated)
    attn = engine.core.worker.runner.attn_layers
    assert attn and all(isinstance(m.bound_ops.get("mla_rope"), TritonMLARope) for m in attn)
    check_against_hf(path, prompts, run(engine, prompts, params), 3)


def test_platform_requiring_fused_experts_without_a_provider_stops_startup(checkpoints, monkeypatch):
    """As on CUDA without kernels-triton: no silent fall back to the torch experts path."""
    from keel_platform_cpu.platform import CpuPlatform

    from keel.layers.custom_op import MissingCustomOpError

    monkeypatch.setattr(CpuPlatform, "use_custom_ops", lambda self: True)
    monkeypatch.setattr(CpuPlatform, "required_custom_ops", lambda self: ("fused_experts",))
    with pytest.raises(MissingCustomOpError, match=r"'fused_experts' is required.*model\.layers\.1\.mlp\.experts"):
        make_engine(checkpoints["v2"], plugins=["platform-cpu", "attention-torch", "models-deepseek"])


def test_shared_experts_kept_separate_when_fusion_is_disabled(checkpoints):
    path = checkpoints["v2"]
    engine = make_engine(path, disable_shared_experts_fusion=True)
    model = engine.core.worker.runner.model
    assert model.shared_experts_fusion.num_fused == 0
    assert model.model.layers[1].mlp.shared_experts is not None
    prompts = random_prompts([7, 12], seed=6)
    check_against_hf(path, prompts, run(engine, prompts, GREEDY), 8)
