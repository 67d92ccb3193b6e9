"""Test-only helpers: tiny random DeepSeek-V2/V3 checkpoints and a one-step paged prefill driver."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from keel_attention_torch.mla import TorchMLABackend
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from keel.attention.metadata import CommonAttentionMetadata
from keel.forward_context import ForwardContext
from keel.models.interface import ModelBuildContext
from keel.models.loader import load_model

VOCAB = 300

TINY: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 32,
    "q_lora_rank": None,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

HIDDEN, NUM_LAYERS = TINY["hidden_size"], TINY["num_hidden_layers"]

# DeepSeek's YaRN: scaled rope with mscale != mscale_all_dim (cos/sin scale) and mscale_all_dim (softmax).
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 0.9,
    "mscale_all_dim": 0.8,
    "beta_fast": 32,
    "beta_slow": 1,
}


def tiny_deepseek_config(version: int, **overrides: Any) -> Any:
    import transformers

    cls = transformers.DeepseekV2Config if version == 2 else transformers.DeepseekV3Config
    kwargs = {**TINY, **overrides}
    if version == 3:
        kwargs.setdefault("n_group", 4)
        kwargs.setdefault("topk_group", 2)
    return cls(**kwargs)


@torch.no_grad()
def make_deepseek_checkpoint(version: int, path: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Write a float32 random DeepSeek-V`version` checkpoint (HF's released per-expert layout)."""
    from transformers import AutoModelForCausalLM

    config = tiny_deepseek_config(version, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    # O(1) weights (HF's 0.02-std init makes logits too flat for a 1e-4 comparison to mean much).
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=g))
        elif name.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        else:  # [..., out, in]
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    path = Path(path)
    model.save_pretrained(path)
    return path


def make_mtp_checkpoint(path, *, mtp: bool = True, extra: dict | None = None, drop: tuple[str, ...] = (),
                        declare: int = 1, **overrides: Any) -> Path:
    """A V3 checkpoint with `num_nextn_predict_layers=declare`; `mtp` writes model.layers.2.* tensors: the
    last decoder layer copied, eh_proj mostly passing the token embedding, shared_head tied to the target's
    norm and lm_head; every block's output damped (the model is close to a bigram model)."""
    make_deepseek_checkpoint(3, path, num_nextn_predict_layers=declare, **overrides)
    file = path / "model.safetensors"
    w = load_file(str(file))
    for name in list(w):  # damp every block's output: the residual stream stays near the embedding
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = w[name] * 0.1
    if mtp:
        g = torch.Generator().manual_seed(7)
        src, dst = f"model.layers.{NUM_LAYERS - 1}.", f"model.layers.{NUM_LAYERS}."
        for name in [n for n in w if n.startswith(src)]:
            w[dst + name[len(src):]] = w[name].clone()
        noise = torch.randn(HIDDEN, HIDDEN, generator=g) * 0.1 / math.sqrt(HIDDEN)
        w[dst + "eh_proj.weight"] = torch.cat((torch.eye(HIDDEN), noise), dim=1)
        w[dst + "enorm.weight"] = torch.ones(HIDDEN)
        w[dst + "hnorm.weight"] = torch.ones(HIDDEN)
        w[dst + "shared_head.norm.weight"] = w["model.norm.weight"].clone()
        w[dst + "shared_head.head.weight"] = w["lm_head.weight"].clone()
        w[dst + "embed_tokens.weight"] = w["model.embed_tokens.weight"].clone()
        for name in drop:
            del w[dst + name]
        for name, t in (extra or {}).items():
            w[dst + name] = t
    save_file(w, str(file), metadata={"format": "pt"})
    return path


def build_context(path: Path, dtype: torch.dtype = torch.float32, block_size: int = 4) -> ModelBuildContext:
    return ModelBuildContext(
        hf_config=AutoConfig.from_pretrained(path),
        dtype=dtype,
        device=torch.device("cpu"),
        block_size=block_size,
        attention_backend=None,
        mla_backend=TorchMLABackend,
    )


def load_keel(model_cls: Any, path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return load_model(model_cls, build_context(path, dtype), path)


@torch.no_grad()
def prefill_logits(model: Any, prompts: Sequence[Sequence[int]], block_size: int = 4) -> torch.Tensor:
    """All prompts as one varlen step over fresh paged latent caches; logits at every token."""
    lens = [len(p) for p in prompts]
    blocks = [-(-n // block_size) for n in lens]
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    next_block = 1  # block 0 is the null block
    for i, nb in enumerate(blocks):
        table[i, :nb] = torch.arange(next_block, next_block + nb, dtype=torch.int32)
        next_block += nb
    positions = torch.cat([torch.arange(n) for n in lens])
    req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    slots = table[req, positions // block_size].long() * block_size + positions % block_size
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens, seq_lens_cpu=seq_lens,
        block_table=table, slot_mapping=slots, num_reqs=len(lens), num_actual_tokens=int(qsl[-1]),
        max_query_len=max(lens), max_seq_len=max(lens), block_size=block_size,
    )
    layers = model.attention_layers()
    md = layers[0].backend.get_metadata_builder(torch.device("cpu")).build(common)
    caches = [
        torch.zeros(layer.backend.kv_cache_shape(next_block, layer.kv_cache_spec()), dtype=layer.kv_cache_spec().dtype)
        for layer in layers
    ]
    ctx = ForwardContext(attn_metadata=[md] * len(layers), kv_caches=caches, num_actual_tokens=int(qsl[-1]))
    input_ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)
    return model.compute_logits(model(input_ids, positions, ctx)).float()


@torch.no_grad()
def hf_logits(path: Path, prompts: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
    return torch.cat([ref(torch.tensor([p])).logits[0].float() for p in prompts])


def random_prompts(lens: Sequence[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]
