"""DecodeGraphRunner: the model's forward on pure-decode steps, captured as CUDA graphs per batch size.

Dynamic above, static below: the scheduler and runner keep request churn; this helper owns static
input buffers (token ids, positions, seq lens, block table, slot mapping) sized for the largest
captured batch, captures one graph per bucketed batch size, and on a decode step copies the step's
inputs into the buffers, pads the batch up to the next bucket (padding requests have seq_len 0 and
slot -1, so attention reads and writes nothing for them) and replays.

Named by a platform's `GraphCaptureSpec.capturer`; built by `ModelRunner.capture_cuda_graphs` after the
KV cache exists, unless `enforce_eager`. Only attention backends declaring `supports_cuda_graph` (their
decode metadata references only the common metadata's device tensors) are captured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from keel.attention.metadata import CommonAttentionMetadata
from keel.forward_context import ForwardContext

logger = logging.getLogger("keel.worker")


class DecodeGraphRunner:
    """Created once per worker by the model runner; `capture` once, then `run` on every decode step."""

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
    ) -> None:
        if not batch_sizes:
            raise ValueError("DecodeGraphRunner needs at least one batch size to capture")
        self.model = model
        self.builders = list(builders)
        self.layer_builder = list(layer_builder)
        self.kv_caches = kv_caches
        self.device = device
        self.block_size = block_size
        self.sizes = sorted(set(batch_sizes))
        self.max_model_len = max_model_len
        max_b = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_b, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_b, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_b, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_b + 1, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(max_b, max_blocks, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((max_b,), -1, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0

    def _context(self, b: int) -> ForwardContext:
        common = CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[: b + 1],
            query_start_loc_cpu=torch.arange(b + 1, dtype=torch.int32),
            seq_lens=self.seq_lens[:b],
            seq_lens_cpu=torch.ones(b, dtype=torch.int32),
            block_table=self.block_table[:b],
            slot_mapping=self.slot_mapping[:b],
            num_reqs=b,
            num_actual_tokens=b,
            max_query_len=1,
            # Launch shapes may depend on this bound, never on the step's actual lengths.
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
        )
        metas = [builder.build(common) for builder in self.builders]
        return ForwardContext(attn_metadata=[metas[i] for i in self.layer_builder], kv_caches=self.kv_caches,
                              num_actual_tokens=b)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size, largest first so the smaller graphs reuse its memory pool."""
        start = time.perf_counter()
        pool = None
        for b in reversed(self.sizes):
            ctx = self._context(b)
            for _ in range(2):  # compile kernels and settle the allocator outside the graph
                self.model(self.input_ids[:b], self.positions[:b], ctx)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(self.input_ids[:b], self.positions[:b], ctx)
            pool = graph.pool()
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s", len(self.graphs), self.sizes,
                    time.perf_counter() - start)

    def bucket(self, num_reqs: int) -> int | None:
        """The captured batch size a decode step of `num_reqs` requests pads to, or None (run eagerly)."""
        return next((b for b in self.sizes if b >= num_reqs), None)

    def run(
        self,
        input_ids: torch.Tensor,  # [num_reqs] int64, any device
        positions: torch.Tensor,  # [num_reqs] int64
        common: CommonAttentionMetadata,
    ) -> torch.Tensor | None:  # hidden [num_reqs, hidden_size], or None when this step cannot replay
        """Called by the model runner every step; replays when the step is pure decode and fits a bucket.

        The returned tensor is the graph's output buffer: valid until the next `run`.
        """
        n = common.num_reqs
        b = self.bucket(n)
        width = common.block_table.shape[1]
        if (b is None or common.max_query_len != 1 or common.num_actual_tokens != n
                or width > self.block_table.shape[1] or not self.graphs):
            return None
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.seq_lens[:n].copy_(common.seq_lens[:n], non_blocking=True)
        self.seq_lens[n:b].zero_()
        self.slot_mapping[:n].copy_(common.slot_mapping[:n], non_blocking=True)
        self.slot_mapping[n:b].fill_(-1)
        self.block_table[:n, :width].copy_(common.block_table[:n], non_blocking=True)
        graph, out = self.graphs[b]
        graph.replay()
        self.num_replays += 1
        return out[:n]
