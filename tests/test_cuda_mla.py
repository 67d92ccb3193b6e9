"""triton_mla compiled on a GPU (skipped without one).

Kernels: DeepSeek-sized MLA (kv_lora_rank 512, rope 64, nope/v 128, 16 heads) over a NaN-poisoned
paged latent cache against a float64 fully expanded reference, in float32 / bfloat16 / float16, on a
mixed batch (split-K decodes of long and short contexts, prefill, chunked prefill, -1 padding rows).
Engine: a tiny DeepSeek-V2 through keel on cuda with `attention_backend: auto` (must land on
triton_mla) generates transformers' greedy tokens in float32, with decode CUDA graphs and eagerly.

Imports of the Triton backend stay inside the tests: on a machine without a GPU this module must not
compile-decorate the kernels before the attention-flash tests switch the interpreter on.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

H, N, R, V, L = 16, 128, 64, 128, 512
ATOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 6e-3}


def _step(context_lens, query_lens, bs, gen, pad_rows):
    from keel.attention.metadata import CommonAttentionMetadata

    totals = [c + q for c, q in zip(context_lens, query_lens)]
    blocks = [-(-t // bs) for t in totals]
    perm = (torch.randperm(sum(blocks) + 2, generator=gen) + 1).tolist()
    table = torch.zeros(len(totals), max(blocks) + 1, dtype=torch.int32)
    for i, nb in enumerate(blocks):
        table[i, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
    latents = [torch.randn(t, L + R, generator=gen, dtype=torch.float64) for t in totals]
    rows, slots = [], []
    for i, (c, t) in enumerate(zip(context_lens, totals)):
        for p in range(c, t):
            slots.append(int(table[i, p // bs]) * bs + p % bs)
            rows.append(latents[i][p])
    num = len(slots)
    rows += [torch.zeros(L + R, dtype=torch.float64)] * pad_rows
    slots += [-1] * pad_rows
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(totals, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.cuda(), query_start_loc_cpu=qsl, seq_lens=seq.cuda(), seq_lens_cpu=seq,
        block_table=table.cuda(), slot_mapping=torch.tensor(slots).cuda(), num_reqs=len(totals),
        num_actual_tokens=num, max_query_len=max(query_lens), max_seq_len=max(totals), block_size=bs,
    )
    cache = torch.full((sum(blocks) + 3, bs, L + R), float("nan"), dtype=torch.float64)
    for i, c in enumerate(context_lens):
        for p in range(c):
            cache[table[i, p // bs], p % bs] = latents[i][p]
    return latents, torch.stack(rows), common, cache


def _reference(q, latents, context_lens, query_lens, w_uk, w_uv, scale):  # float64, fully expanded
    out, start = [], 0
    for lat, c, n in zip(latents, context_lens, query_lens):
        lat = lat.cuda()
        k = torch.cat((torch.einsum("sl,hnl->hsn", lat[:, :L], w_uk), lat[None, :, L:].expand(H, -1, -1)), -1)
        v = torch.einsum("sl,hvl->hsv", lat[:, :L], w_uv)
        scores = q[start : start + n].transpose(0, 1) @ k.transpose(1, 2) * scale
        mask = torch.arange(c + n, device="cuda")[None, :] <= torch.arange(c, c + n, device="cuda")[:, None]
        out.append((scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs", [16, 64])
def test_deepseek_sized_mixed_batch_matches_expanded_reference(dtype, bs):
    from keel_attention_flash.mla_backend import TritonMLABackend

    from keel.attention.backend import AttentionLayerConfig, BackendRequest

    context_lens, query_lens = (0, 1000, 37, 0, 300, 2047), (45, 1, 1, 130, 17, 1)
    gen = torch.Generator().manual_seed(bs)
    latents, new, common, cache64 = _step(context_lens, query_lens, bs, gen, pad_rows=3)
    w_uk = (torch.randn(H, N, L, generator=gen, dtype=torch.float64) / L**0.5).cuda()
    w_uv = (torch.randn(H, V, L, generator=gen, dtype=torch.float64) / L**0.5).cuda()
    q = torch.randn(new.shape[0], H, N + R, generator=gen, dtype=torch.float64).cuda()
    layer = AttentionLayerConfig(
        num_heads=H, num_kv_heads=1, head_size=L + R, scale=(N + R) ** -0.5, dtype=dtype, block_size=bs,
        use_mla=True,
        extra=(("kv_lora_rank", L), ("qk_nope_head_dim", N), ("qk_rope_head_dim", R), ("v_head_dim", V)),
    )
    assert TritonMLABackend.validate(BackendRequest(layer, "cuda", "mla_latent")) == []
    impl = TritonMLABackend.get_impl(layer)
    impl.process_weights_after_loading(w_uk.to(dtype), w_uv.to(dtype))
    md = TritonMLABackend.get_metadata_builder(torch.device("cuda")).build(common)
    cache = cache64.to(dtype).cuda()
    new_dev = new.cuda().to(dtype)
    qd = q.to(dtype)
    out = impl.forward(qd[..., :N], qd[..., N:], new_dev[:, :L], new_dev[:, L:], cache, md)
    num = common.num_actual_tokens
    # The reference sees the inputs rounded to `dtype`, so only the kernel's own error remains.
    rounded = [lat.to(dtype).double() for lat in latents]
    ref = _reference(q.to(dtype).double()[:num], rounded, context_lens, query_lens, w_uk.to(dtype).double(),
                     w_uv.to(dtype).double(), layer.scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:num].double(), ref, atol=ATOL[dtype], rtol=0)
    written = cache.view(-1, L + R)[common.slot_mapping[:num]]
    assert torch.equal(written, new_dev[:num])


def _make_tiny_deepseek(path, version: int = 2):
    import transformers

    common = {
        "vocab_size": 512, "hidden_size": 128, "intermediate_size": 192, "moe_intermediate_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 8, "num_key_value_heads": 8, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "kv_lora_rank": 64, "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32, "v_head_dim": 32, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }
    if version == 2:
        config = transformers.DeepseekV2Config(**common, q_lora_rank=None)
    else:  # V3: q LoRA, sigmoid routing with correction bias, group-limited top-k
        config = transformers.DeepseekV3Config(**common, q_lora_rank=48, n_group=2, topk_group=1,
                                               norm_topk_prob=True, routed_scaling_factor=2.5)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=[2, 3], ids=["v2", "v3"])
def deepseek_ckpt(tmp_path_factory, request):
    return _make_tiny_deepseek(tmp_path_factory.mktemp("cuda_mla") / f"dsv{request.param}", request.param)


@pytest.mark.parametrize("eager", [False, True])
def test_deepseek_greedy_equals_transformers_on_cuda(deepseek_ckpt, eager):
    """float32 on the GPU: greedy tokens equal, logprobs within 1e-4, through chunked prefill (budget 64 <
    the 130-token prompt), then again for the same prompts served from the prefix cache."""
    from transformers import AutoModelForCausalLM

    from keel import SamplingParams
    from keel.config import EngineArgs
    from keel.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(deepseek_ckpt), skip_tokenizer_init=True, dtype="float32", block_size=16, max_model_len=256,
        plugins=["platform-cuda", "attention-flash", "attention-torch", "models-deepseek", "kernels-triton"],
        platform="cuda",
        attention_backend="auto", max_num_seqs=8, max_num_batched_tokens=64, gpu_memory_utilization=0.3,
        enforce_eager=eager,
    ))
    runner = engine.core.worker.runner
    assert {layer.backend.name for layer in runner.attn_layers} == {"triton_mla"}
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 37, 1, 130, 64, 9)]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    hits_before = engine.get_metrics()["prefix_cache_hits_total"]
    for i, p in enumerate(prompts):
        engine.add_request(f"again{i}", {"prompt_token_ids": p}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    assert engine.get_metrics()["prefix_cache_hits_total"] > hits_before
    for i in range(len(prompts)):
        assert done[f"again{i}"].token_ids == done[f"r{i}"].token_ids
    if not eager:
        assert runner.cuda_graphs is not None and runner.cuda_graphs.num_replays > 0
    hf = AutoModelForCausalLM.from_pretrained(deepseek_ckpt, dtype=torch.float32,
                                              attn_implementation="eager").cuda().eval()
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ids = torch.tensor([p], device="cuda")
            logprobs = []
            for _ in range(10):
                lp = torch.log_softmax(hf(ids).logits[0, -1].float(), -1)
                nxt = lp.argmax()
                logprobs.append(float(lp[nxt]))
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            got = done[f"r{i}"]
            assert list(got.token_ids) == ids[0, len(p):].tolist(), f"prompt {i}: greedy tokens differ"
            ours = [next(iter(d.values())).logprob for d in got.logprobs]
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(logprobs), atol=1e-4, rtol=0)
