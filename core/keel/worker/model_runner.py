"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

Per step: update the request mirrors, flatten all scheduled tokens into one varlen batch (token ids,
positions, slot mapping, block table), build the attention metadata once, run the model, compute logits
only at sampling positions, sample, and report. With a draft proposer every step is a verify step run by
`worker/spec_step.py:SpecStepRunner` (drafts verified and proposed on the device). It never touches
scheduler state.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence

import numpy as np
import torch

from keel.attention.metadata import CommonAttentionMetadata
from keel.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from keel.forward_context import ForwardContext
from keel.kv_cache.spec import KVCacheSpec
from keel.layers.sampler import Sampler, compute_logprobs
from keel.layers.token_bitmask import TokenBitmask
from keel.logits_processor import LogitsProcessor
from keel.spec_decode.proposer import DraftProposer
from keel.worker.async_output import AsyncModelRunnerOutput, InFlightTokens, SampledLaunch
from keel.worker.grammar_constraint import GrammarConstraint, grammar_arrays, staged_constraint
from keel.worker.input_batch import InputBatch, table_width
from keel.worker.logits_batch import LogitsProcessorBatch
from keel.worker.request_state import CachedRequestState
from keel.worker.sampling_batch import BatchSamplingState
from keel.worker.staging import StagingBuffer, pinned_empty, record_event

logger = logging.getLogger("keel.worker")
_ROW = operator.attrgetter("row")  # a CachedRequestState's InputBatch row


# Prefill warm-up sizes past this many tokens also run one and five short of each power of two (ModelRunner.warm_up).
ODD_WARM_UP_PAST = 512


def warm_up_prefill_sizes(max_num_tokens: int) -> list[int]:
    """The prefill token counts `ModelRunner.warm_up` runs at startup, ascending. A kernel whose launch
    variants depend on the token count must meet each of its variants at one of these sizes (its plugin's
    tests check that it does), or it compiles under load in the first big batch."""
    sizes = sorted({min(1 << i, max_num_tokens) for i in range(max_num_tokens.bit_length() + 1)})
    # Triton specializes integer arguments on divisibility by 16, so from 16 up every power of two is
    # one variant. Kernels some paths take only at large sizes (fp8 activation quantization's chunked
    # launch, from 512 rows) met their other variant in the first big batch (H200 at 8c848ae: 2 compiles
    # in round 1 of the fp8 Llama engine, 0.44 s): one count short of each power of two past 512 too.
    # Five short too: the block-fp8 cuBLAS path pads M to 4 rows and passes that count as its scales'
    # stride, so n - 1 (padded to n) and n - 5 (padded to n - 4, not a multiple of 16) are two variants
    # (H200 at 548c96a: two _quant_fp8_kernel compiles at a 634-token step in round 1 of block-fp8 DSV2).
    return sorted(set(sizes) | {n - d for n in sizes if n > ODD_WARM_UP_PAST for d in (1, 5)})


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, block_size: int,
                 proposer: DraftProposer | None = None, num_speculative_tokens: int = 0,
                 max_model_len: int | None = None, pipeline=None,
                 logits_processors: Sequence[LogitsProcessor] = (), dp_lockstep: bool = False,
                 max_num_seqs: int = 64) -> None:
        self.model = model
        # Plugin logits processors (keel.logits_processor) and the layout of their rows, or None.
        self.logits_processors = LogitsProcessorBatch(logits_processors) if logits_processors else None
        # Data-parallel replicas whose MoE layers exchange tokens: a step with nothing scheduled here
        # still runs a dummy forward when another DP rank has work, so the collectives pair up.
        self.dp_lockstep = dp_lockstep
        # keel.distributed.pipeline.PipelineStage under pipeline parallelism: only its last stage samples.
        self.pipeline = pipeline
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.device = device
        self.block_size = block_size
        self.sampler = Sampler()
        self.token_bitmask = TokenBitmask()  # the worker binds a kernel plugin's op into it
        self.requests: dict[str, CachedRequestState] = {}
        # Rows for max_num_seqs requests from the start: growing copies every row (tens of MB at long
        # max_model_len) inside the first step that holds more requests.
        self.input_batch = InputBatch(block_size, max_num_reqs=max_num_seqs,
                                      max_model_len=max_model_len or 256)
        self.sampling_state = BatchSamplingState(device)
        self.staging = StagingBuffer(device)
        self.vocab_size: int | None = None  # the logits' width, known after the first sampling step
        # The logits' width of the last profile_run (None: pooling models, non-last pipeline stages): the
        # startup warm-up compiles the sampler for it before any step has sampled.
        self._profiled_vocab: int | None = None
        self.in_flight = InFlightTokens(self.input_batch)
        self.kv_caches: list[torch.Tensor] = []
        self.attn_layers = list(model.attention_layers())
        # A draft model's layers (MTP) get caches like the target's; their layer_idx continues after them.
        if proposer is not None and hasattr(proposer, "attention_layers"):
            self.attn_layers += list(proposer.attention_layers())
        # One metadata builder per distinct backend; layer i uses builder _layer_builder[i].
        builders: dict[type, object] = {}
        for layer in self.attn_layers:
            if layer.backend not in builders:
                builders[layer.backend] = layer.backend.get_metadata_builder(device)
        self._builders = list(builders.values())
        self._layer_builder = [list(builders).index(layer.backend) for layer in self.attn_layers]
        self.cuda_graphs = None  # a DecodeGraphRunner once capture_cuda_graphs ran
        self.draft_graphs = None  # a DraftGraphRunner: the device proposer's drafts on verify graphs
        # A model with a pooler (SupportsPooling) serves pooling requests; a pooling-only one has no LM head.
        self.pooling_model = hasattr(model, "pool")
        from keel.worker.spec_step import SpecStepRunner

        self.spec = SpecStepRunner(self) if proposer is not None else None

    # ---------------------------------------------------------------- KV cache

    def kv_cache_spec(self) -> KVCacheSpec:
        """The spec the block manager allocates for. All layers share block ids (one group).

        Layers may differ in page size (each has its own tensor); full-attention and sliding-window
        layers mixed are allocated as full attention (sliding layers simply never read old blocks).
        """
        specs = [layer.kv_cache_spec() for layer in self.attn_layers]
        if len({s.block_size for s in specs}) != 1:
            raise NotImplementedError("attention layers with different block sizes are not supported yet")
        kinds = {s.kind for s in specs}
        if len(kinds) == 1:
            return specs[0]
        if kinds <= {"full_attention", "sliding_window"}:
            return next(s for s in specs if s.kind == "full_attention")
        raise NotImplementedError(f"mixing KV cache kinds {sorted(kinds)} is not supported yet")

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one block id costs across all layers."""
        return sum(layer.kv_cache_spec().page_size_bytes for layer in self.attn_layers)

    def _allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        """One zeroed cache tensor per attention layer, in the backend's layout for its spec."""
        caches = []
        for layer in self.attn_layers:
            spec = layer.kv_cache_spec()
            shape = layer.backend.kv_cache_shape(num_blocks, spec)
            caches.append(torch.zeros(shape, dtype=spec.dtype, device=self.device))
        return caches

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate one cache tensor per attention layer; num_blocks includes the null block 0."""
        self.kv_caches = self._allocate_kv_caches(num_blocks)

    def free_kv_cache(self) -> None:
        """Drop the cache tensors and the decode graphs captured over them (sleep mode); the worker's
        `initialize_kv_cache` allocates and captures them again."""
        self.cuda_graphs = None
        self.draft_graphs = None
        self.kv_caches = []

    @property
    def has_kv_cache(self) -> bool:
        return bool(self.kv_caches)

    def capture_cuda_graphs(self, spec, max_num_seqs: int, max_model_len: int) -> bool:
        """Called by the worker after `initialize_kv_cache` unless enforce_eager; `spec` is the platform's
        GraphCaptureSpec. Returns whether graphs were captured (every layer's backend must allow it)."""
        import importlib

        if not spec.supported or not spec.capturer or not spec.batch_sizes:
            return False
        if self.pipeline is not None:
            logger.info("decode CUDA graphs off: pipeline stages exchange tensors every step")
            return False
        if self.dp_lockstep:
            logger.info("decode CUDA graphs off: the MoE layers' token exchange across DP ranks changes size every step")
            return False
        refusing = sorted({layer.backend.name for layer in self.attn_layers
                           if not getattr(layer.backend, "supports_cuda_graph", False)})
        if refusing:
            logger.info("decode CUDA graphs off: attention backend(s) %s cannot be captured", refusing)
            return False
        # Buckets up to max_num_seqs only: a padded batch never holds more rows than the engine sized for. Where
        # max_num_seqs is not a bucket, the decode steps above the largest one run eagerly; startup says so, once,
        # rather than leaving a throughput cliff under load to be found in a profile.
        sizes = [b for b in spec.batch_sizes if b <= max_num_seqs] or [min(spec.batch_sizes)]
        if max_num_seqs > sizes[-1]:
            logger.warning("decode CUDA graphs cover batches up to %d of max_num_seqs %d: decode steps of %d-%d "
                           "requests run eagerly (a max_num_seqs among the platform's buckets avoids it)",
                           sizes[-1], max_num_seqs, sizes[-1] + 1, max_num_seqs)
        module, _, attr = spec.capturer.partition(":")
        capturer = getattr(importlib.import_module(module), attr)
        from keel.worker.cuda_graph import graph_query_lens

        # Verify steps (1 + k tokens per request) are captured too where every backend allows it.
        query_lens = graph_query_lens([layer.backend for layer in self.attn_layers], self.num_speculative_tokens)
        self.cuda_graphs = capturer(self.model, self._builders, self._layer_builder, self.kv_caches, self.device,
                                    self.block_size, sizes, max_model_len,
                                    **({"query_lens": query_lens} if query_lens != (1,) else {}))
        self.cuda_graphs.capture()
        if len(query_lens) > 1 and getattr(self.proposer, "cuda_graph_safe", False):
            from keel.worker.draft_graph import DraftGraphRunner

            self.draft_graphs = DraftGraphRunner(self.proposer, self.cuda_graphs, self.kv_caches, self.block_size,
                                                 max_model_len, query_lens[-1])
            self.draft_graphs.capture()
        return True

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, max_num_seqs: int, max_model_len: int,
                    decode_seq_lens: Sequence[int] = (), dp_num_tokens: tuple[int, ...] = ()) -> int:
        """A dummy prefill of `num_tokens` tokens (requests of at most `max_model_len`) plus logits for
        up to `max_num_seqs` rows, on a temporary KV cache: the activation peak of the largest step.
        `decode_seq_lens` adds one decode request (one new token) per entry with that sequence length,
        after the prefills -- a mixed step, or a pure decode step when `num_tokens` is 0.

        Called by the worker before sizing the KV cache; returns the temporary cache's bytes (part of
        the measured peak that the real cache will replace). `dp_num_tokens`: the step's DP token counts
        when this is an idle DP rank's stand-in forward (`execute_model_async`).
        """
        lens = []
        left = num_tokens
        while left > 0 and len(lens) < max_num_seqs:
            lens.append(min(left, max_model_len))
            left -= lens[-1]
        query = lens + [1] * len(decode_seq_lens)  # new tokens per request
        seq_lens = lens + [min(s, max_model_len) for s in decode_seq_lens]
        bs = self.block_size
        blocks = [-(-n // bs) for n in seq_lens]
        caches = self._allocate_kv_caches(sum(blocks) + 1)
        table = torch.zeros(len(seq_lens), table_width(max(blocks)), dtype=torch.int32)  # as real steps
        first = 1
        for i, n in enumerate(blocks):
            table[i, :n] = torch.arange(first, first + n, dtype=torch.int32)
            first += n
        qsl = torch.zeros(len(query) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(query), 0)
        seq = torch.tensor(seq_lens, dtype=torch.int32)
        pos = torch.cat([torch.arange(s - q, s) for q, s in zip(query, seq_lens)])
        req = torch.repeat_interleave(torch.arange(len(query)), torch.tensor(query))
        slots = table[req, pos // bs].to(torch.int64) * bs + pos % bs
        dev = self.device
        common = CommonAttentionMetadata(
            query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=seq.to(dev), seq_lens_cpu=seq,
            block_table=table.to(dev), slot_mapping=slots.to(dev), num_reqs=len(query),
            num_actual_tokens=int(qsl[-1]), max_query_len=max(query), max_seq_len=max(seq_lens), block_size=bs,
        )
        metas = [builder.build(common) for builder in self._builders]
        ctx = ForwardContext(attn_metadata=[metas[b] for b in self._layer_builder], kv_caches=caches,
                             num_actual_tokens=common.num_actual_tokens, dp_num_tokens=dp_num_tokens)
        input_ids = torch.zeros(common.num_actual_tokens, dtype=torch.int64, device=dev)
        if self.pipeline is None:
            hidden = self.model(input_ids, pos.to(dev), ctx)
        else:  # every stage alone, on stand-in inputs: the same shapes, no exchange
            hidden = self.pipeline.forward_alone(self.model, input_ids, pos.to(dev), ctx)
        if hidden is not None and not self.pooling_model:
            rows = torch.arange(min(max_num_seqs, hidden.shape[0]), device=dev)
            # [rows, vocab]: in float32, as the sampler and the bitmask see them (the profile's largest intermediate)
            logits = self.model.compute_logits(hidden[rows]).float()
            self._profiled_vocab = logits.shape[-1]
            if getattr(self.token_bitmask, "bound_ops", None):  # compiled here, not in the first constrained step
                words = -(-logits.shape[-1] // 32)
                self.token_bitmask(logits, torch.full((1, words), -1, dtype=torch.int32, device=dev), rows[:1])
            logits.softmax(dim=-1)  # the sampler's largest intermediate
        return sum(c.numel() * c.element_size() for c in caches)

    def warm_up(self, max_num_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
        """Dummy steps (`profile_run`) that compile every kernel variant a step can select.

        Called by the worker at startup on device platforms, before the KV cache exists. A prefill of
        every power-of-two token count up to `max_num_tokens` (fused-MoE tile configurations per token
        count, prefill attention); then one decode of every power-of-two context length up to
        `max_model_len`, alone and beside a small prefill (decode kernels pick launch variants such as
        split-K counts from the context length; mixed steps launch them another way). Without it the
        first big batch after start compiled them under load: on an H200 ~7.6 s for the MoE tiles of
        DeepSeek-V2-Lite, and 0.7 s for an MLA decode variant. Past ODD_WARM_UP_PAST tokens also one and
        five counts short of each power of two (sizes not a multiple of 16, padded to 4 or not). Then the
        sampler's compiled noise (`Sampler.warm_up`). Returns the prefill token counts run.
        """
        sizes = warm_up_prefill_sizes(max_num_tokens)
        for n in sizes:
            self.profile_run(n, max_num_seqs, max_model_len)
        contexts = sorted({min(1 << i, max_model_len) for i in range(max_model_len.bit_length() + 1)})
        for s in contexts:
            self.profile_run(0, max_num_seqs, max_model_len, decode_seq_lens=[s])
            self.profile_run(min(16, max_num_tokens - 1), max_num_seqs, max_model_len, decode_seq_lens=[s])
        if self._profiled_vocab is not None:
            self.sampler.warm_up(self._profiled_vocab, max_num_seqs, self.device)
        return sizes

    # ---------------------------------------------------------------- step

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for rid in so.finished_req_ids:
            state = self.requests.pop(rid, None)
            if state is not None:
                batch.remove_request(state.row)
        for new in so.scheduled_new_reqs:
            old = self.requests.pop(new.req_id, None)
            if old is not None:  # resumed without a forget in between: start over
                batch.remove_request(old.row)
            state = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                seed=new.seed,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                stop_token_ids=new.stop_token_ids,
                pooling_params=new.pooling_params,
            )
            state.row = batch.add_request(state.token_ids, new.num_prompt_tokens, new.num_computed_tokens,
                                          state.block_ids, new.sampling_params, new.seed, new.stop_token_ids)
            self.requests[new.req_id] = state
        cached = so.scheduled_cached_reqs
        requests, computed = self.requests, batch.num_computed_tokens
        # Tokens the last stage sampled: the scheduler relays them (this stage samples nothing).
        relay = cached.new_token_ids if self.pipeline is not None and not self.pipeline.is_last else None
        for i, (rid, new_block_ids, num_computed) in enumerate(zip(cached.req_ids, cached.new_block_ids,
                                                                   cached.num_computed_tokens)):
            state = requests[rid]
            if relay and relay[i]:
                state.token_ids.extend(relay[i])
                batch.append_tokens(state.row, relay[i])
            if new_block_ids:
                state.block_ids.extend(new_block_ids)
                batch.append_block_ids(state.row, new_block_ids)
            state.num_computed_tokens = num_computed
            computed[state.row] = num_computed

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step, waiting for its sampled tokens (the synchronous engine core, tests)."""
        return self.execute_model_async(so).get_output()

    @torch.inference_mode()
    def execute_model_async(self, so: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Called by the worker once per scheduled step; returns once the step is enqueued on the device.

        Tokens sampled by the previous step that the host has not seen yet (async scheduling) are fed
        to this step on the device. With a draft proposer every step is a verify step (`SpecStepRunner`).
        A step whose grammar bitmask is still being filled enqueues its sampling once the bitmask is there:
        at the latest when the next step starts here.
        """
        self.in_flight.finish_sampling()  # the previous step's sampling comes before anything of this one
        self._update_states(so)
        if so.is_empty:
            if self.dp_lockstep and any(so.dp_num_tokens):  # another DP rank has work: join its exchange
                self.profile_run(1, 1, 1, dp_num_tokens=so.dp_num_tokens)
            return AsyncModelRunnerOutput(ModelRunnerOutput(req_ids=[], sampled_token_ids=[]), None)
        if self.spec is not None:  # speculative decoding: every step verifies (worker/spec_step.py)
            return self.spec.execute(so)
        if self.logits_processors is not None:
            self.in_flight.wait()  # logits processors see every committed output token

        req_ids = list(so.num_scheduled_tokens)
        num_reqs = len(req_ids)
        states = list(map(self.requests.__getitem__, req_ids))
        batch = self.input_batch
        rows = np.fromiter(map(_ROW, states), dtype=np.int64, count=num_reqs)
        if batch.has_bad_words[rows].any():
            self.in_flight.wait()  # bad words read each row's last output tokens on the host
        num_scheduled = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=num_reqs)
        step = batch.prepare_inputs(rows, num_scheduled)
        pooling = [i for i, s in enumerate(states) if s.pooling_params is not None] if self._has_pooling() else []
        if pooling:
            step.num_sample_rows[pooling] = 0  # a pooling request is pooled, never sampled

        # Flat rows whose next token is sampled (drafts: one row each + 1), and (batch index, rows).
        sampling_idx = np.flatnonzero(step.num_sample_rows)
        sample_counts = step.num_sample_rows[sampling_idx]
        sample_rows = step.query_start_loc[1:][sampling_idx].astype(np.int64) - 1  # one row per request
        num_sampling = int(sampling_idx.shape[0])
        num_tokens = int(step.input_ids.shape[0])

        # Everything the step needs on the device, in one copy.
        arrays = {
            "input_ids": step.input_ids, "positions": step.positions, "query_start_loc": step.query_start_loc,
            "seq_lens": step.seq_lens, "block_table": step.block_table, "slot_mapping": step.slot_mapping,
            "sample_rows": sample_rows,
        }
        fixups = self.in_flight.fixups(rows, num_scheduled, step.query_start_loc)
        if fixups is not None:
            arrays["fixup_dst"], arrays["fixup_src"] = fixups
        sample_batch_rows = rows[sampling_idx]
        one_each = num_sampling > 0 and self.vocab_size is not None
        if one_each:
            for name, arr in self.sampling_state.host_arrays(batch, sample_batch_rows, self.vocab_size).items():
                arrays["sampling." + name] = arr
        grammar = so.grammar_bitmask
        if grammar is not None:
            arrays.update(grammar_arrays(grammar, [req_ids[b] for b in sampling_idx.tolist()], sample_counts))
        t = self.staging.stage(arrays)
        input_ids = t["input_ids"]
        if fixups is not None:
            # The previous step's tokens, straight from the device (the host has not seen them yet).
            input_ids.index_copy_(0, t["fixup_dst"], self.in_flight.sampled.index_select(0, t["fixup_src"]))
        common = CommonAttentionMetadata(
            query_start_loc=t["query_start_loc"],
            query_start_loc_cpu=torch.from_numpy(step.query_start_loc),
            seq_lens=t["seq_lens"],
            seq_lens_cpu=torch.from_numpy(step.seq_lens),
            block_table=t["block_table"],
            slot_mapping=t["slot_mapping"],
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
            block_size=self.block_size,
        )
        hidden = self._forward(input_ids, t["positions"], common, so)

        out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[] for _ in req_ids])
        launch = None
        if num_sampling and hidden is not None:  # pipeline stages before the last sample nothing
            constraint = staged_constraint(grammar, t)
            staged = {k[9:]: v for k, v in t.items() if k.startswith("sampling.")} if one_each else None
            launch = self._sample_one_each(states, sample_batch_rows, sampling_idx, t["sample_rows"], hidden,
                                           out, staged=staged, constraint=constraint)
        if pooling and hidden is not None:
            self._pool(states, pooling, step.query_start_loc.tolist(), num_scheduled, hidden, out)
        if hidden is not None and batch.wants_prompt_logprobs[rows].any():
            self._prompt_logprobs(so, req_ids, states, step.query_start_loc.tolist(), hidden, out)
        return self.in_flight.track(out, launch)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, common: CommonAttentionMetadata,
                 so: SchedulerOutput) -> torch.Tensor | None:
        """The model over a step's flat tokens: a CUDA graph replay where one fits, else eager; None on a
        pipeline stage before the last. input_ids, positions: [num_tokens]; returns [num_tokens, hidden]."""
        hidden = None if self.cuda_graphs is None else self.cuda_graphs.run(input_ids, positions, common)
        if hidden is not None:
            return hidden
        metas = [builder.build(common) for builder in self._builders]
        ctx = ForwardContext(
            attn_metadata=[metas[b] for b in self._layer_builder],
            kv_caches=self.kv_caches,
            num_actual_tokens=common.num_actual_tokens,
            dp_num_tokens=so.dp_num_tokens,
        )
        if self.pipeline is None:
            return self.model(input_ids, positions, ctx)
        return self.pipeline.forward(self.model, input_ids, positions, ctx)  # None on every stage but the last

    def _has_pooling(self) -> bool:
        return any(s.pooling_params is not None for s in self.requests.values()) if self.pooling_model else False

    def _pool(self, states, pooling: list[int], query_start: list[int], num_scheduled: np.ndarray,
              hidden: torch.Tensor, out: ModelRunnerOutput) -> None:
        """Keep the pooling requests' prompt hidden states (chunked prefill spreads them over steps); a
        request whose prompt is complete is pooled by the model and leaves its vector in `out`.
        hidden: [num_tokens, hidden_size]."""
        for i in pooling:
            state = states[i]
            state.pooled_hidden.append(hidden[query_start[i]:query_start[i + 1]])
            if state.num_computed_tokens + int(num_scheduled[i]) < state.num_prompt_tokens:
                continue
            prompt_hidden = torch.cat(state.pooled_hidden)  # [prompt_len, hidden_size]
            state.pooled_hidden = []
            qsl = torch.tensor([0, prompt_hidden.shape[0]], dtype=torch.int32, device=prompt_hidden.device)
            vector = self.model.pool(prompt_hidden, qsl)[0].float()  # [pooled_size]
            if state.pooling_params.normalize:
                vector = torch.nn.functional.normalize(vector, dim=-1)
            out.pooler_output[state.req_id] = vector.cpu().tolist()

    def _sample_one_each(self, states, sample_batch_rows: np.ndarray, sampling_idx: np.ndarray,
                         sample_rows: torch.Tensor, hidden, out: ModelRunnerOutput,
                         staged: dict[str, torch.Tensor] | None = None,
                         constraint: GrammarConstraint | None = None) -> SampledLaunch | None:
        """A step without drafts: one sampled token per sampling request, metadata from the input batch.

        sample_batch_rows: [S] InputBatch rows; sampling_idx: [S] batch indices; sample_rows: [S] rows
        of `hidden` (device); constraint: the step's grammar bitmask, applied before sampling. Enqueues
        the logits, then sampling and the copy of the tokens to the host -- at once, or, while the bitmask
        is still being filled, when the launch is finished (`SampledLaunch.finish`); the tokens' values
        reach the input batch and `out` when the returned launch is committed.
        """
        batch = self.input_batch
        rows_states = [states[i] for i in sampling_idx.tolist()] if self.logits_processors is not None else ()
        logits, meta = self._logits_and_metadata(hidden, sample_rows, sample_batch_rows, staged, rows_states)
        sampling_list = sampling_idx.tolist()
        launch = SampledLaunch(
            req_ids=out.req_ids,
            sampling_idx=sampling_list,
            rows=sample_batch_rows,
            generations=batch.generation[sample_batch_rows],
            positions=batch.advance(sample_batch_rows),
            num_logprobs=batch.num_logprobs[sample_batch_rows].tolist(),
            states=states if len(sampling_list) == len(states) else [states[i] for i in sampling_list],
        )

        @torch.inference_mode()  # also when run from get_output
        def sample(into: SampledLaunch) -> None:  # not a closure over `launch`: launch.pending holds it
            masked = logits if constraint is None else self.token_bitmask(logits, *constraint.on_device(self.device))
            result = self.sampler(masked, meta)
            sampled = result.sampled_token_ids  # [S] int64, device
            self.sampling_state.record_sampled(batch, sample_batch_rows, sampled,
                                               None if staged is None else staged["rows"])
            lps = None if result.logprobs is None else (result.logprob_token_ids, result.logprobs, result.ranks)
            into.sampled, into.sampled_host, into.logprobs_host = sampled, sampled, lps
            if self.device.type != "cpu":
                into.sampled_host = pinned_empty(sampled.shape, sampled.dtype, self.device).copy_(
                    sampled, non_blocking=True)
                if lps is not None:
                    into.logprobs_host = tuple(pinned_empty(x.shape, x.dtype, self.device).copy_(x, non_blocking=True)
                                               for x in lps)
                into.event = record_event(self.device)
            into.enqueued.set()

        if constraint is None or constraint.ready:
            sample(launch)
        else:
            launch.pending = sample
        return launch

    def _logits_and_metadata(self, hidden, sample_rows: torch.Tensor, sample_batch_rows: np.ndarray,
                             staged: dict[str, torch.Tensor] | None, rows_states: Sequence[CachedRequestState] = ()):
        """Logits at `sample_rows` of `hidden` ([S, vocab]) and the sampler's metadata for those batch
        rows; every path that samples (eager, CUDA graphs, the last pipeline stage) masks the logits with
        the step's constraint after this, before the sampler. `rows_states`: the requests of the rows, in
        order, for the logits processors (given when there are some)."""
        logits = self.model.compute_logits(hidden[sample_rows])  # [S, vocab]
        vocab = logits.shape[-1]
        if self.vocab_size is None:
            self.vocab_size = vocab
        elif vocab != self.vocab_size:
            raise RuntimeError(f"the model's logits have {vocab} columns, expected {self.vocab_size}")
        meta = self.sampling_state.build(self.input_batch, sample_batch_rows, vocab, staged=staged)
        if self.logits_processors is not None:
            meta.logitsprocs = self.logits_processors.step(rows_states)
        return logits, meta

    def _prompt_logprobs(self, so, req_ids, states, query_start, hidden, out: ModelRunnerOutput) -> None:
        for i, (rid, state) in enumerate(zip(req_ids, states)):
            k = state.sampling_params.prompt_logprobs
            if k is None:
                continue
            start = state.num_computed_tokens
            end = min(start + so.num_scheduled_tokens[rid], state.num_prompt_tokens - 1)
            if end <= start:
                continue
            rows = torch.arange(query_start[i], query_start[i] + end - start, device=self.device)
            logits = self.model.compute_logits(hidden[rows])
            targets = torch.tensor(state.token_ids[start + 1 : end + 1], device=self.device)
            ids, lps, ranks = compute_logprobs(logits, targets, k)
            out.prompt_logprobs[rid] = (start, ids.tolist(), lps.tolist(), ranks.tolist())
