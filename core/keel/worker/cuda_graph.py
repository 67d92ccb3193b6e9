"""DecodeGraphRunner: the model's forward on uniform steps, captured as CUDA graphs per (query length,
batch size).

A uniform step is one where every request has exactly q new tokens: pure decode (q = 1) or a speculative
verify step where every request carries the same number of drafts (q = 1 + num_speculative_tokens).

Dynamic above, static below: the scheduler and runner keep request churn; this helper owns static
input buffers (token ids, positions, seq lens, block table, slot mapping) sized for the largest
captured batch times the largest query length, captures one graph per (q, bucketed batch size), and on
a uniform step copies the step's inputs into the buffers, pads the batch up to the next bucket (padding
requests have seq_len 0 and q tokens with slot -1, so attention reads and writes nothing for them) and
replays. Any other step (prefill, mixed, drafts of different lengths) runs eagerly.

Named by a platform's `GraphCaptureSpec.capturer`; built by `ModelRunner.capture_cuda_graphs` after the
KV cache exists, unless `enforce_eager`. Only attention backends declaring `supports_cuda_graph` are
captured, and steps of q > 1 only up to every backend's `cuda_graph_max_query_len` (see
`graph_query_lens`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from keel.attention.metadata import CommonAttentionMetadata
from keel.forward_context import ForwardContext
from keel.worker.input_batch import table_width

logger = logging.getLogger("keel.worker")

GraphKey = tuple[int, int]  # (query length per request, padded batch size)


def graph_query_lens(backends: Iterable[object], num_speculative_tokens: int) -> tuple[int, ...]:
    """The query lengths the model runner should ask `DecodeGraphRunner` to capture: (1,), plus
    1 + num_speculative_tokens when speculative decoding is on and every attention backend declares
    `cuda_graph_max_query_len` at least that large (a backend without the attribute captures q = 1 only).
    """
    if num_speculative_tokens <= 0:
        return (1,)
    q = 1 + num_speculative_tokens
    limits = {getattr(b, "name", repr(b)): getattr(b, "cuda_graph_max_query_len", 1) for b in backends}
    too_small = sorted(name for name, limit in limits.items() if limit < q)
    if too_small:
        logger.info("speculative verify steps (%d tokens per request) run eagerly: attention backend(s) %s "
                    "capture at most %s", q, too_small, {n: limits[n] for n in too_small})
        return (1,)
    return (1, q)


def _first(t: torch.Tensor, n: int) -> torch.Tensor:
    """`t[:n]`, without a slicing op when `t` has exactly n rows (a step's own tensors do)."""
    return t if t.shape[0] == n else t[:n]


class DecodeGraphRunner:
    """Created once per worker by the model runner; `capture` once, then `run` on every step.

    `query_lens` are the per-request query lengths captured (each with every batch size); the model
    runner passes `graph_query_lens(...)`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        builders: Sequence[object],
        layer_builder: Sequence[int],
        kv_caches: Sequence[torch.Tensor],
        device: torch.device,
        block_size: int,
        batch_sizes: Sequence[int],
        max_model_len: int,
        *,
        query_lens: Sequence[int] = (1,),
    ) -> None:
        if not batch_sizes:
            raise ValueError("DecodeGraphRunner needs at least one batch size to capture")
        bad = [q for q in query_lens if not isinstance(q, int) or q < 1]
        if not query_lens or bad:
            raise ValueError(f"DecodeGraphRunner query_lens must be positive ints, got {list(query_lens)}")
        self.model = model
        self.builders = list(builders)
        self.layer_builder = list(layer_builder)
        self.kv_caches = kv_caches
        self.device = device
        self.block_size = block_size
        self.sizes = sorted(set(batch_sizes))
        self.query_lens = sorted(set(query_lens))
        self.max_model_len = max_model_len
        max_b = self.sizes[-1]
        max_t = max_b * self.query_lens[-1]
        max_blocks = table_width(-(-max_model_len // block_size))  # as wide as any step's table
        self.input_ids = torch.zeros(max_t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_t, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_b, dtype=torch.int32, device=device)
        # Per query length: request i owns rows [i * q, (i + 1) * q), padding requests included.
        self._qsl_np = {q: np.arange(max_b + 1, dtype=np.int64) * q for q in self.query_lens}
        self.query_start_locs = {q: torch.from_numpy(v).to(device=device, dtype=torch.int32)
                                 for q, v in self._qsl_np.items()}
        self.block_table = torch.zeros(max_b, max_blocks, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((max_t,), -1, dtype=torch.int64, device=device)
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0
        self.replays_by_query_len: dict[int, int] = dict.fromkeys(self.query_lens, 0)
        self.pool = None  # the graphs' memory pool, once captured
        self.last_key: GraphKey | None = None  # the graph the last `run` replayed (None: eager)
        # (q, b, num_reqs, table width) -> the static buffers' slices a step of that shape copies into
        self._stage_views: dict[tuple[int, int, int, int], tuple] = {}

    @property
    def keys(self) -> list[GraphKey]:
        """Every (query length, batch size) to capture, most tokens first (the first graph's memory pool
        is the largest; the others reuse it)."""
        return sorted(((q, b) for q in self.query_lens for b in self.sizes), key=lambda k: (-k[0] * k[1], -k[0]))

    def common(self, b: int, q: int = 1) -> CommonAttentionMetadata:
        """The common metadata every replay of graph (q, b) sees, over the static buffers (also what a
        draft graph reading this graph's output sees: `worker/draft_graph.py`)."""
        qsl_cpu = torch.from_numpy(self._qsl_np[q][: b + 1]).to(torch.int32)
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_locs[q][: b + 1],
            query_start_loc_cpu=qsl_cpu,
            seq_lens=self.seq_lens[:b],
            seq_lens_cpu=torch.full((b,), q, dtype=torch.int32),
            block_table=self.block_table[:b],
            slot_mapping=self.slot_mapping[: b * q],
            num_reqs=b,
            num_actual_tokens=b * q,
            max_query_len=q,
            # Launch shapes may depend on this bound, never on the step's actual lengths.
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
        )

    def _context(self, b: int, q: int = 1) -> ForwardContext:
        """The forward context every replay of graph (q, b) sees: the builders' metadata over the static
        buffers. Built once per graph, before capture; launch shapes may depend on (q, b) and
        max_model_len, never on a step's actual lengths."""
        common = self.common(b, q)
        metas = [builder.build(common) for builder in self.builders]
        return ForwardContext(attn_metadata=[metas[i] for i in self.layer_builder], kv_caches=self.kv_caches,
                              num_actual_tokens=b * q)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (query length, batch size), most tokens first so the others reuse its pool."""
        start = time.perf_counter()
        pool = None
        for q, b in self.keys:
            ctx = self._context(b, q)
            t = b * q
            for _ in range(2):  # compile kernels and settle the allocator outside the graph
                self.model(self.input_ids[:t], self.positions[:t], ctx)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(self.input_ids[:t], self.positions[:t], ctx)
            pool = graph.pool()
            self.graphs[(q, b)] = (graph, out)
        self.pool = pool  # draft graphs share it
        torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs (query lengths %s x batch sizes %s) in %.1f s", len(self.graphs),
                    self.query_lens, self.sizes, time.perf_counter() - start)

    def bucket(self, num_reqs: int) -> int | None:
        """The captured batch size a step of `num_reqs` requests pads to, or None (run eagerly)."""
        return next((b for b in self.sizes if b >= num_reqs), None)

    def graph_key(self, num_tokens: int, common: CommonAttentionMetadata) -> GraphKey | None:
        """(q, padded batch) of the graph that can run this step, or None: the step is not uniform (some
        request has another number of new tokens), q was not captured, or the batch or its block table
        is larger than captured. Reads only host values (no device sync)."""
        n, q = common.num_reqs, common.max_query_len
        if n == 0 or q not in self._qsl_np:
            return None
        b = self.bucket(n)
        if (b is None or (q, b) not in self.graphs or common.num_actual_tokens != n * q or num_tokens != n * q
                or common.block_table.shape[1] > self.block_table.shape[1]):
            return None
        # Drafts of different lengths (some requests drafted fewer tokens) make the step non-uniform.
        if not np.array_equal(_first(common.query_start_loc_cpu, n + 1).numpy(), self._qsl_np[q][: n + 1]):
            return None
        return q, b

    def _stage(self, key: GraphKey, input_ids: torch.Tensor, positions: torch.Tensor,
               common: CommonAttentionMetadata) -> None:
        """Copy the step into the static buffers; padding requests get seq_len 0 and slots -1."""
        q, b = key
        n = common.num_reqs
        t = n * q
        width = common.block_table.shape[1]
        views = self._stage_views.get((q, b, n, width))
        if views is None:  # slicing is a tensor op (host time on the GPU): once per shape
            if len(self._stage_views) >= 1024:
                self._stage_views.clear()
            views = self._stage_views[(q, b, n, width)] = (
                self.input_ids[:t], self.positions[:t], self.seq_lens[:n], self.slot_mapping[:t],
                self.block_table[:n, :width], self.seq_lens[n:b] if n < b else None,
                self.slot_mapping[t : b * q] if n < b else None)
        ids, pos, seq_lens, slots, table, pad_seq_lens, pad_slots = views
        ids.copy_(_first(input_ids, t), non_blocking=True)
        pos.copy_(_first(positions, t), non_blocking=True)
        seq_lens.copy_(_first(common.seq_lens, n), non_blocking=True)
        slots.copy_(_first(common.slot_mapping, t), non_blocking=True)
        table.copy_(_first(common.block_table, n), non_blocking=True)
        if pad_seq_lens is not None:
            pad_seq_lens.zero_()
            pad_slots.fill_(-1)

    def _replay(self, key: GraphKey) -> torch.Tensor:  # [b * q, hidden_size], the graph's output buffer
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def run(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64, any device
        positions: torch.Tensor,  # [num_tokens] int64
        common: CommonAttentionMetadata,
    ) -> torch.Tensor | None:  # hidden [num_actual_tokens, hidden_size], or None: run this step eagerly
        """Called by the model runner every step; replays when the step is uniform with a captured query
        length and fits a bucket.

        The returned tensor is the graph's output buffer: valid until the next `run`. `last_key` is the
        graph this call replayed, None when the step runs eagerly (a draft graph follows it).
        """
        self.last_key = key = self.graph_key(int(input_ids.shape[0]), common) if self.graphs else None
        if key is None:
            return None
        self._stage(key, input_ids, positions, common)
        out = self._replay(key)
        self.num_replays += 1
        self.replays_by_query_len[key[0]] += 1
        return out[: common.num_reqs * key[0]]
