"""DraftGraphRunner: a device proposer's drafts on uniform verify steps, captured as CUDA graphs.

MTP drafts with one pass over every row of the verify step and then k - 1 one-token passes, each a
decoder layer plus an lm_head: ~50 small launches per pass, many of them Triton's (tens of microseconds
of Python each). Run eagerly they cost more host time than the GPU needs for them: on the H200 an MTP
k = 3 step at batch 1 took 11.7 ms against a 3.7 ms plain step, of which the verify forward itself is a
graph replay. So where the target's verify step replays graph (1 + k, b), the drafts replay graph
(1 + k, b) of this runner: it reads the target graph's output buffer (the hidden states), positions and
block table, and its own static buffers for the tokens after each row, each request's last accepted row
and its block count. Padding requests (rows n .. b of the bucket) draft from their own first row with
no blocks, so they write no KV and their drafts are dropped.

Drafts only steer speed: the target verifies every draft, so a wrong one costs acceptance, never output.

Built by `ModelRunner.capture_cuda_graphs` after the target's graphs, when the proposer declares
`cuda_graph_safe` (its `propose_on_device` reads only the `DraftInput` device fields and syncs nothing).
"""

from __future__ import annotations

import logging
import time

import torch

from keel.spec_decode.proposer import DraftInput
from keel.worker.cuda_graph import DecodeGraphRunner, GraphKey

logger = logging.getLogger("keel.worker")


class DraftGraphRunner:
    """Owned by the model runner; `capture` once after the target's graphs, `run` on every verify step."""

    def __init__(self, proposer, target: DecodeGraphRunner, kv_caches, block_size: int, max_model_len: int,
                 query_len: int) -> None:
        self.proposer = proposer
        self.target = target
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.query_len = q = query_len
        dev = target.device
        max_b = target.sizes[-1]
        self.next_tokens = torch.zeros(max_b * q, dtype=torch.int64, device=dev)  # [B * q]
        self.last_valid = torch.arange(max_b, dtype=torch.int64, device=dev) * q  # [B]
        self.num_blocks = torch.zeros(max_b, dtype=torch.int64, device=dev)  # [B]
        self._own_rows = self.last_valid.clone()  # a padding request's last valid row: its first
        self._drafting = torch.arange(max_b, dtype=torch.int64, device=dev)  # every request drafts
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0

    def _input(self, b: int) -> DraftInput:
        q = self.query_len
        t = self.target
        _, hidden = t.graphs[(q, b)]
        return DraftInput(
            req_ids=[""] * b, token_ids=[[] for _ in range(b)], max_drafts=[0] * b,
            hidden_states=hidden[: b * q], block_size=self.block_size, kv_caches=self.kv_caches,
            positions=t.positions[: b * q], next_token_ids=self.next_tokens[: b * q],
            last_valid_rows=self.last_valid[:b], attn_metadata=t.common(b, q), drafting=self._drafting[:b],
            num_blocks=self.num_blocks[:b], max_model_len=self.max_model_len,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size the target captured at the verify length, in the target's pool. A
        proposer that turns out not to be capturable is logged and left eager (no graphs)."""
        start = time.perf_counter()
        q = self.query_len
        pool = self.target.pool
        try:
            for b in sorted((b for (ql, b) in self.target.graphs if ql == q), reverse=True):
                batch = self._input(b)
                for _ in range(2):  # compile kernels and settle the allocator outside the graph
                    self.proposer.propose_on_device(batch)
                torch.cuda.synchronize(self.target.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.proposer.propose_on_device(batch)
                self.graphs[(q, b)] = (graph, out)
        except RuntimeError as err:  # e.g. a host sync inside propose_on_device
            logger.warning("MTP drafts run eagerly: capturing them as CUDA graphs failed (%s)", err)
            self.graphs.clear()
            return
        torch.cuda.synchronize(self.target.device)
        logger.info("captured %d draft CUDA graphs (query length %d) in %.1f s", len(self.graphs), q,
                    time.perf_counter() - start)

    def run(self, key: GraphKey | None, n: int, next_tokens: torch.Tensor, last_valid: torch.Tensor,
            num_blocks: torch.Tensor) -> torch.Tensor | None:  # [n, k] int64 drafts, or None: run eagerly
        """Called by the spec step right after the target replayed graph `key` for n requests, every one
        of them sampling. next_tokens: [n * q] the token after each row; last_valid: [n] each request's
        last accepted row; num_blocks: [n] its block table entries."""
        entry = self.graphs.get(key) if key is not None else None
        if entry is None:
            return None
        q, b = key
        self.next_tokens[: n * q].copy_(next_tokens[: n * q])
        self.next_tokens[n * q : b * q].zero_()
        self.last_valid[:n].copy_(last_valid[:n])
        self.last_valid[n:b].copy_(self._own_rows[n:b])
        self.num_blocks[:n].copy_(num_blocks[:n])
        self.num_blocks[n:b].zero_()
        graph, out = entry
        graph.replay()
        self.num_replays += 1
        return out[:n].clone()  # the next replay overwrites the graph's buffer
