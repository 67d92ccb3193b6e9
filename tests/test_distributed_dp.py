"""Data parallelism: the DP scheduler (replicas, balancing, aborts, merged stats) and, on the CPU ("mp"
executor, gloo), dense Llama replicas at DP=2 (with async scheduling) equal to transformers and the
one-rank run. DeepSeek's attention DP with EP: the models_deepseek plugin's tests."""

from __future__ import annotations

import pytest
import torch

from keel import SamplingParams
from keel.config import ConfigError, EngineArgs
from keel.engine.dp_scheduler import DataParallelScheduler
from keel.engine.request import EngineCoreRequest
from keel.engine.scheduler import Scheduler
from keel.engine.scheduler_output import DataParallelRunnerOutput, ModelRunnerOutput
from keel.kv_cache.manager import KVCacheManager
from keel.kv_cache.spec import FullAttentionSpec
from keel.layers.fused_moe import FusedMoEParallelConfig
from keel.distributed.grid import RankGrid
from keel.testing.checkpoints import make_checkpoint
from keel.testing.distributed import check_stress, run_stress_engine


def _dp_scheduler(dp: int) -> DataParallelScheduler:
    return DataParallelScheduler([
        Scheduler(KVCacheManager(FullAttentionSpec(4, torch.float32, 1, 8), 32), max_num_seqs=8,
                  max_num_batched_tokens=16, max_model_len=32) for _ in range(dp)])


def _request(rid: str, n: int = 5) -> EngineCoreRequest:
    first = 3 + 10 * (ord(rid[0]) - ord("a"))  # distinct prompts: no prefix hits between them
    return EngineCoreRequest(rid, list(range(first, first + n)), SamplingParams(max_tokens=2, ignore_eos=True),
                             None, 0)


def test_dp_scheduler_balances_routes_aborts_and_merges_stats():
    dp = _dp_scheduler(2)
    for rid in "abc":
        dp.add_request(_request(rid), 2)
    assert [sorted(s.requests) for s in dp.schedulers] == [["a", "c"], ["b"]]  # fewest unfinished, then lowest
    with pytest.raises(ValueError, match="already in use"):
        dp.add_request(_request("a"), 2)
    out = dp.schedule()
    assert [p.dp_num_tokens for p in out.parts] == [(10, 5), (10, 5)]
    assert [sorted(p.num_scheduled_tokens) for p in out.parts] == [["a", "c"], ["b"]]
    runner = DataParallelRunnerOutput(tuple(
        ModelRunnerOutput(req_ids=list(p.num_scheduled_tokens), sampled_token_ids=[[7]] * len(p.num_scheduled_tokens))
        for p in out.parts))
    outs = dp.update_from_output(out, runner)  # one of two tokens each
    assert sorted(o.request_id for o in outs) == ["a", "b", "c"] and not any(o.finish_reason for o in outs)
    aborted = dp.abort_requests(["b", "zz"])
    assert [o.request_id for o in aborted] == ["b"] and not dp.schedulers[1].has_unfinished_requests()
    stats = dp.make_stats()
    assert (stats.num_running_reqs, stats.prompt_tokens_total, stats.generation_tokens_total) == (2, 15, 3)
    assert stats.num_finished_total == {"abort": 1}


def test_expert_parallel_ranks_follow_the_grid():
    grid = RankGrid(tp_size=2, dp_size=2)
    (ep_group,) = grid.ep_groups()
    for rank in range(grid.world_size):
        c = grid.coords(rank)
        moe = FusedMoEParallelConfig.make(2, c.tp_rank, True, 2, c.dp_rank)
        assert (moe.ep_size, ep_group[moe.ep_rank], moe.dp_rank) == (4, rank, c.dp_rank)


def test_data_parallel_settings_are_checked():
    args = {"platform": "cpu", "data_parallel_size": 2}
    with pytest.raises(ConfigError, match="'uni' runs one worker"):
        EngineArgs(**args, distributed_executor_backend="uni").create_engine_config(require_model=False)
    with pytest.raises(ConfigError, match="data_parallel_size must be"):
        EngineArgs(platform="cpu", data_parallel_size=0).create_engine_config(require_model=False)
    with pytest.raises(ConfigError, match=r"x data_parallel_size = 16 ranks"):
        EngineArgs(**args, tensor_parallel_size=8).create_engine_config(require_model=False)


def test_dense_data_parallel_replicas_match_transformers_and_one_rank(tmp_path):
    path = make_checkpoint("llama", tmp_path / "llama")
    one_rank = run_stress_engine(path, 300)
    # Each replica has its own 14-block cache (it still preempts); the two prefix-hit prompts arrive when
    # both replicas are idle and go to replica 0, which served the prompt they extend.
    run = run_stress_engine(path, 300, data_parallel_size=2, async_scheduling=True, max_model_len=48,
                            num_kv_blocks=14)
    check_stress(path, run.prompts, run.results, run.metrics, reference=one_rank.results)
