"""DeepSeek-V3 multi-token prediction (MTP) as a speculative-decoding proposer (`spec_decoder` key "mtp").

Checkpoints with `num_nextn_predict_layers >= 1` store MTP module m under `model.layers.{L + m}.*`
(L = num_hidden_layers): `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, `shared_head.head`,
`embed_tokens` and one full decoder block (MLA attention + MoE or dense MLP by DeepSeek's layer rule).
For position i the module computes, as DeepSeek-V3 and vLLM do,

    x_i = eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i)))     h_i: the target's final (normed) hidden
    g_i = block(x_i)                                          pre-norm output (residual added)
    logits_i = shared_head.head(shared_head.norm(g_i))        predicts t_{i+2}

Draft 1 is the argmax at the last committed position; drafts 2..k reuse the same module recursively
(g of the previous step as the "previous hidden", the previous draft as the token), as vLLM does with
one MTP module. Only the first MTP module drafts; further ones in a checkpoint are not loaded. (vLLM
also zeroes the token embedding at position 0; keel does not -- drafts only change acceptance rates.)

KV state: the module's MLA layer has its own latent cache, allocated by the runner with the target's
block ids (`attention_layers()`; its layer_idx follows the target's). Every step it is run over every
position the target computed whose next token is committed -- prefill chunks that sample nothing
included -- so its cache is complete; draft steps write tentatively at later positions, which the next
step overwrites (the scheduler lowers num_computed_tokens; nothing tentative is hashed). The MTP KV at
a block's last position depends on the *next* block's first token, so a prefix-cache hit may hand the
draft layer a slightly different context than a fresh run would: drafts may differ, outputs never do
(verification decides every token).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from keel.attention.metadata import CommonAttentionMetadata
from keel.forward_context import ForwardContext
from keel.layers.layernorm import RMSNorm
from keel.layers.linear import ReplicatedLinear
from keel.layers.mla_attention import MLAAttention
from keel.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding, compute_logits
from keel.models.interface import ModelBuildContext
from keel.models.loader import default_dtype, init_dummy_weights, iterate_safetensors
from keel.models.weights import WeightLoadError, load_mapped_weights
from keel.quantization import prepare_checkpoint
from keel.spec_decode.proposer import DraftInput, ProposerContext
from keel_models_deepseek.deepseek_v2 import DeepseekV2DecoderLayer

logger = logging.getLogger("keel.spec_decode.mtp")


class MTPConfigError(ValueError):
    """speculative method "mtp" asked of a model or checkpoint that has no usable MTP module."""


class SharedHead(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = ParallelLMHead(config.vocab_size, config.hidden_size)


class DeepSeekMultiTokenPredictorLayer(DeepseekV2DecoderLayer):
    """One MTP module: the decoder block's parameters keep their checkpoint names (`self_attn.*`,
    `mlp.*`, `input_layernorm`, ...) beside `enorm`, `hnorm`, `eh_proj`, `shared_head`, `embed_tokens`."""

    def __init__(self, config: Any, layer_idx: int, build: ModelBuildContext, version: int, prefix: str) -> None:
        super().__init__(config, layer_idx, build, version, prefix)
        hidden = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, False, prefix=f"{prefix}.eh_proj")
        self.shared_head = SharedHead(config)

    def forward_mtp(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64: t_{i+1} for position i
        positions: torch.Tensor,  # [num_tokens] int64: i
        prev_hidden: torch.Tensor,  # [num_tokens, hidden]: target final hidden h_i, or the previous g
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [num_tokens, hidden]: g_i, before shared_head.norm
        x = torch.cat((self.enorm(self.embed_tokens(input_ids)), self.hnorm(prev_hidden)), dim=-1)
        hidden, residual = super().forward(positions, self.eh_proj(x), None, ctx)
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] float32
        return compute_logits(self.shared_head.head, self.shared_head.norm(hidden))




def _iter_prefixed(path: Path, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name without `prefix`, tensor) for checkpoint tensors under `prefix`, reading no other tensor."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({f for name, f in weight_map.items() if name.startswith(prefix)})
        paths = [path / f for f in files]
    else:
        paths = sorted(path.glob("*.safetensors"))
    if not paths:  # no safetensors: stream the .bin files (reads everything)
        yield from ((n[len(prefix):], t) for n, t in iterate_safetensors(path) if n.startswith(prefix))
        return
    for file in paths:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names = list(f.keys())
            for name in names:
                if name.startswith(prefix):
                    yield name[len(prefix):], f.get_tensor(name)


class DeepSeekMTPProposer:
    """Drafts with the checkpoint's first MTP module; registered by models-deepseek as `mtp`.

    Built by the worker (`DeepSeekMTPProposer(ProposerContext)`) after the target model is loaded and
    before the model runner, which asks `attention_layers()` for the layers to allocate caches for,
    then calls `propose` once per step with every scheduled request (see `DraftInput`). Raises
    `MTPConfigError` at construction when the checkpoint has no MTP module and `WeightLoadError` when
    its MTP tensors do not match (strict: every tensor of the module consumed, every parameter filled).
    """

    def __init__(self, ctx: ProposerContext) -> None:
        build: ModelBuildContext | None = ctx.build
        if build is None:
            raise MTPConfigError("the mtp proposer needs ProposerContext.build (the target's build context)")
        config = build.hf_config
        num_mtp = getattr(config, "num_nextn_predict_layers", 0) or 0
        if num_mtp < 1 or not hasattr(ctx.model, "stacked_params_mapping"):
            raise MTPConfigError(
                f"speculative_config method 'mtp' needs a DeepSeek-V3-style checkpoint with multi-token "
                f"prediction layers (config.json num_nextn_predict_layers >= 1, weights under "
                f"model.layers.{getattr(config, 'num_hidden_layers', '?')}.*); this model "
                f"({type(ctx.model).__name__}) has num_nextn_predict_layers={num_mtp}. Use a checkpoint "
                f"that ships its MTP weights, or another method such as 'ngram'."
            )
        if num_mtp > 1:
            logger.warning("checkpoint has %d MTP modules; drafting with the first only", num_mtp)
        self.k = ctx.num_speculative_tokens
        self.device = build.device
        num_layers = config.num_hidden_layers
        attn_idx = len(ctx.model.attention_layers())
        with torch.device(build.device), default_dtype(build.dtype):
            self.layer = DeepSeekMultiTokenPredictorLayer(
                config, num_layers, build, getattr(ctx.model, "version", 3), f"model.layers.{num_layers}"
            )
        self.mla: MLAAttention = self.layer.self_attn.mla_attn
        self.mla.layer_idx = attn_idx  # its cache follows the target's in the runner's list
        self._load(ctx, f"model.layers.{num_layers}.")
        self.layer.eval()
        self._builder = self.mla.backend.get_metadata_builder(self.device)

    def draft_modules(self) -> list[nn.Module]:
        """Called by the worker once, before the runner: the layers it binds custom ops into (the MoE
        kernels above all: unbound, the torch experts path would run inside the draft step)."""
        return [self.layer]

    @torch.no_grad()
    def _load(self, ctx: ProposerContext, prefix: str) -> None:
        build = ctx.build
        if ctx.load_format == "dummy":
            loaded = init_dummy_weights(self.layer)
        else:
            if ctx.model_path is None:
                raise MTPConfigError("the mtp proposer needs ProposerContext.model_path to read its weights")
            model = ctx.model
            skip = tuple(getattr(model, "skip_substrs", ()))
            tensors = list(prepare_checkpoint(build.quant_method, _iter_prefixed(Path(ctx.model_path), prefix)))
            if not tensors:
                raise MTPConfigError(
                    f"config.json declares num_nextn_predict_layers >= 1 but checkpoint {ctx.model_path} has no "
                    f"{prefix}* tensors (some conversions drop them); use a checkpoint with its MTP weights"
                )
            loaded = load_mapped_weights(self.layer, tensors, model.stacked_params_mapping(), skip)
        missing = sorted(name for name, p in self.layer.named_parameters()
                     if name not in loaded and not getattr(p, "optional", False))
        if missing:
            raise WeightLoadError(
                f"checkpoint {ctx.model_path} did not fill these MTP parameters (under {prefix}): {missing}",
                missing=missing,
            )
        # Quantization methods first (as the model loader does): MLA then reads the processed kv_b_proj.
        for module in self.layer.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)
        self.layer.self_attn.process_weights_after_loading()

    def attention_layers(self) -> list[MLAAttention]:
        """Called by the model runner at construction: the MTP attention layer needing a KV cache."""
        return [self.mla]

    # ---------------------------------------------------------------- per step

    def _context(
        self, batch: DraftInput, reqs: list[int], positions: list[list[int]]
    ) -> tuple[ForwardContext, torch.Tensor]:
        """Attention metadata for the MTP layer: request reqs[j] computes `positions[j]` (consecutive)."""
        bs = batch.block_size
        qsl, seq_lens, slots = [0], [], []
        for i, pos in zip(reqs, positions):
            blocks = batch.block_ids[i]
            if (pos[-1] // bs) >= len(blocks):
                raise RuntimeError(
                    f"mtp: request {batch.req_ids[i]} has no KV slot for position {pos[-1]} "
                    f"({len(blocks)} blocks of {bs}); the scheduler must reserve num_speculative_tokens "
                    "lookahead slots while spec decoding is on"
                )
            qsl.append(qsl[-1] + len(pos))
            seq_lens.append(pos[-1] + 1)
            slots.extend(blocks[p // bs] * bs + p % bs for p in pos)
        table = torch.zeros((len(reqs), max(len(batch.block_ids[i]) for i in reqs)), dtype=torch.int32)
        for j, i in enumerate(reqs):
            table[j, : len(batch.block_ids[i])] = torch.tensor(batch.block_ids[i], dtype=torch.int32)
        dev = self.device
        qsl_cpu = torch.tensor(qsl, dtype=torch.int32)
        seq_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=qsl_cpu.to(dev), query_start_loc_cpu=qsl_cpu, seq_lens=seq_cpu.to(dev),
            seq_lens_cpu=seq_cpu, block_table=table.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev), num_reqs=len(reqs),
            num_actual_tokens=qsl[-1], max_query_len=max(len(p) for p in positions), max_seq_len=max(seq_lens),
            block_size=bs,
        )
        metadata: list[Any] = [None] * len(batch.kv_caches)
        metadata[self.mla.layer_idx] = self._builder.build(common)
        ctx = ForwardContext(attn_metadata=metadata, kv_caches=batch.kv_caches, num_actual_tokens=qsl[-1])
        flat_pos = torch.tensor([p for pos in positions for p in pos], dtype=torch.int64, device=dev)
        return ctx, flat_pos

    def propose(self, batch: DraftInput) -> list[list[int]]:
        """Called by the runner after sampling (every scheduled request); greedy MTP drafts per request.

        First one MTP forward over every valid position of every request (filling the MTP cache and
        giving draft 1 at each drafting request's last committed position), then k - 1 one-token steps.
        """
        if batch.hidden_states is None or batch.first_positions is None or batch.kv_caches is None:
            raise RuntimeError("mtp: the runner must pass hidden states, positions, block ids and KV caches")
        hidden, dev = batch.hidden_states, self.device
        reqs = [i for i, v in enumerate(batch.num_valid_positions) if v > 0]
        drafts: list[list[int]] = [[] for _ in batch.req_ids]
        if not reqs:
            return drafts
        positions, token_ids, rows = [], [], []
        for i in reqs:
            f, v, r = batch.first_positions[i], batch.num_valid_positions[i], batch.first_rows[i]
            positions.append(list(range(f, f + v)))
            token_ids.extend(batch.token_ids[i][f + 1 : f + v + 1])
            rows.extend(range(r, r + v))
        ctx, pos = self._context(batch, reqs, positions)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=dev)
        g = self.layer.forward_mtp(ids, pos, hidden[torch.tensor(rows, device=dev)], ctx)  # [T, hidden]

        # Drafting requests: index into reqs, and their last valid row of g.
        active = [j for j, i in enumerate(reqs) if batch.max_drafts[i] > 0]
        if not active:
            return drafts
        ends = torch.tensor([sum(len(p) for p in positions[: j + 1]) - 1 for j in active], device=dev)
        prev = g[ends]  # [A, hidden]
        last_pos = [positions[j][-1] for j in active]
        active = [reqs[j] for j in active]  # now batch indices
        for step in range(self.k):
            tokens = self.layer.compute_logits(prev).argmax(dim=-1)  # [A]
            for i, t in zip(active, tokens.tolist()):
                drafts[i].append(t)
            keep = [j for j, i in enumerate(active) if batch.max_drafts[i] > step + 1]
            if not keep:
                break
            active = [active[j] for j in keep]
            last_pos = [last_pos[j] + 1 for j in keep]
            sel = torch.tensor(keep, device=dev)
            ctx, pos = self._context(batch, active, [[p] for p in last_pos])
            prev = self.layer.forward_mtp(tokens[sel], pos, prev[sel], ctx)
        return drafts
