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
row the target computed -- prefill chunks that sample nothing included -- so its cache is complete;
rows past a request's accepted drafts and the draft steps write tentatively at later positions, which
later steps overwrite (the scheduler lowers num_computed_tokens; nothing tentative is hashed). Drafting
runs on the device only (`propose_on_device`), so under async scheduling the next step is built from
these drafts before anything reaches the host. The MTP KV at a block's last position depends on the
*next* block's first token, so a prefix-cache hit may hand the draft layer a slightly different context
than a fresh run would: drafts may differ, outputs never do (verification decides every token).
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

    cuda_graph_safe = True  # propose_on_device: device fields only, no sync (DraftProposer)

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

    def _one_token_context(self, batch: DraftInput, table: torch.Tensor, num_blocks: torch.Tensor,
                           positions: torch.Tensor, max_seq_len: int) -> ForwardContext:
        """Metadata for one draft token per drafting request at `positions` ([D] int64, device), from
        device tensors only: table [D, W] int32 block table rows, num_blocks [D] their filled entries.
        A position without a slot (past max_model_len or the reserved lookahead) writes nothing
        (slot -1); its draft is never kept."""
        bs, dev, d = batch.block_size, self.device, positions.shape[0]
        block = positions // bs
        has_slot = (block < num_blocks) & (positions < batch.max_model_len)
        ids = table.gather(1, block.clamp(max=table.shape[1] - 1)[:, None]).squeeze(1).to(torch.int64)
        slots = torch.where(has_slot, ids * bs + positions % bs, torch.full_like(positions, -1))
        seq = (positions.clamp(max=batch.max_model_len - 1) + 1).to(torch.int32)
        qsl_cpu = torch.arange(d + 1, dtype=torch.int32)
        # The host's lengths are an upper bound where they are not the device's own tensor (graph-safe
        # backends read only max_seq_len); on the CPU they are exact.
        seq_cpu = seq if dev.type == "cpu" else torch.full((d,), max_seq_len, dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=torch.arange(d + 1, dtype=torch.int32, device=dev), query_start_loc_cpu=qsl_cpu,
            seq_lens=seq, seq_lens_cpu=seq_cpu, block_table=table, slot_mapping=slots, num_reqs=d,
            num_actual_tokens=d, max_query_len=1, max_seq_len=max_seq_len, block_size=bs,
        )
        return self._forward_context(batch, common)

    def _forward_context(self, batch: DraftInput, common: CommonAttentionMetadata) -> ForwardContext:
        metadata: list[Any] = [None] * len(batch.kv_caches)
        metadata[self.mla.layer_idx] = self._builder.build(common)
        return ForwardContext(attn_metadata=metadata, kv_caches=batch.kv_caches,
                              num_actual_tokens=common.num_actual_tokens)

    def propose_on_device(self, batch: DraftInput) -> torch.Tensor:  # [n, k] int64
        """Called by the runner once per step, after verification; greedy MTP drafts, on the device.

        One MTP forward over every row the target computed (position i with the token after it and the
        target's hidden h_i; rows past a request's accepted drafts compute tentative KV that later steps
        overwrite, as the target's rejected drafts do), then draft 1 at each drafting request's last
        accepted row and k - 1 one-token steps. No host sync: the runner may build the next step on
        these drafts before any of this step's tokens reach the host.
        """
        common = batch.attn_metadata
        if batch.hidden_states is None or common is None or batch.positions is None or batch.kv_caches is None:
            raise RuntimeError("mtp: the runner must pass hidden states, positions, metadata and KV caches")
        num_tokens = common.num_actual_tokens
        g = self.layer.forward_mtp(batch.next_token_ids[:num_tokens], batch.positions[:num_tokens],
                                   batch.hidden_states[:num_tokens], self._forward_context(batch, common))
        drafts = torch.full((len(batch.req_ids), self.k), -1, dtype=torch.int64, device=self.device)
        which = batch.drafting
        if which is None or which.shape[0] == 0:
            return drafts
        rows = batch.last_valid_rows.index_select(0, which)
        prev = g.index_select(0, rows)  # [D, hidden]
        positions = batch.positions.index_select(0, rows)
        table = common.block_table.index_select(0, which)
        num_blocks = batch.num_blocks.index_select(0, which)
        tokens = []
        for step in range(self.k):
            token = self.layer.compute_logits(prev).argmax(dim=-1)  # [D]
            tokens.append(token)
            if step + 1 == self.k:
                break
            positions = positions + 1
            ctx = self._one_token_context(batch, table, num_blocks, positions,
                                          min(common.max_seq_len + step + 1, batch.max_model_len))
            prev = self.layer.forward_mtp(token, positions.clamp(max=batch.max_model_len - 1), prev, ctx)
        drafts.index_copy_(0, which, torch.stack(tokens, dim=1))
        return drafts
