"""The "priority" scheduling policy (vLLM's): waiting requests are admitted by (priority, arrival), the
least urgent running request is the one preempted; under "fcfs" a non-zero priority is refused."""

from __future__ import annotations

import pytest
import torch

from keel.engine.limits import ParamError
from keel.engine.processor import ProcessedPrompt, Processor
from keel.engine.request import EngineCoreRequest
from keel.engine.sampling_params import SamplingParams
from keel.engine.scheduler import Scheduler
from keel.engine.scheduler_output import ModelRunnerOutput
from keel.kv_cache.manager import KVCacheManager
from keel.kv_cache.spec import FullAttentionSpec

BS = 4


def make_scheduler(policy: str, num_blocks: int, max_num_seqs: int = 8) -> Scheduler:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=4, dtype=torch.float32)
    kv = KVCacheManager(spec, num_blocks=num_blocks, enable_caching=False)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=64,
                     scheduling_policy=policy)


def add(s: Scheduler, rid: str, priority: int, arrival: float, prompt_len: int = 4, max_tokens: int = 20) -> None:
    s.add_request(EngineCoreRequest(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                                    eos_token_id=None, seed=0, arrival_time=arrival, priority=priority), max_tokens)


def step(s: Scheduler) -> list[str]:
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    s.update_from_output(out, ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[7] for _ in ids]))
    return ids


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    s = make_scheduler("priority", num_blocks=64, max_num_seqs=2)
    add(s, "late-low", 5, 1.0)
    add(s, "urgent", -1, 3.0)
    add(s, "early-mid", 0, 0.5)
    add(s, "late-mid", 0, 2.0)
    assert step(s) == ["urgent", "early-mid"]
    fcfs = make_scheduler("fcfs", num_blocks=64, max_num_seqs=2)
    for rid, arrival in (("a", 1.0), ("b", 2.0), ("c", 0.0)):
        add(fcfs, rid, 0, arrival)
    assert step(fcfs) == ["a", "b"]  # fcfs: the order of arrival at the scheduler


def test_the_least_urgent_running_request_is_preempted():
    # 5 blocks of 4 tokens (one is the null block): three 4-token prompts fill 3; the next decode step
    # needs a new block for each of them, and the one free block goes to the most urgent, the least
    # urgent giving way -- not the last to arrive (fcfs would preempt "high").
    s = make_scheduler("priority", num_blocks=5)
    add(s, "low", 9, 0.0)
    add(s, "high", 0, 2.0)
    add(s, "mid", 1, 1.0)
    assert step(s) == ["high", "mid", "low"]
    assert step(s) == ["high", "mid"]
    assert s.requests["low"].num_preemptions == 1 and [r.request_id for r in s.waiting] == ["low"]


def test_priority_needs_the_priority_policy():
    proc = Processor(None, max_model_len=64, vocab_size=100, eos_token_id=None)
    prompt = ProcessedPrompt(None, [1, 2, 3])
    with pytest.raises(ParamError, match="priority scheduling is not enabled") as err:
        proc.make_requests("r", prompt, SamplingParams(), 0.0, priority=3)
    assert err.value.param == "priority"
    assert proc.make_requests("r", prompt, SamplingParams(), 0.0)[0].priority == 0
    ranked = Processor(None, max_model_len=64, vocab_size=100, eos_token_id=None, scheduling_policy="priority")
    assert ranked.make_requests("r", prompt, SamplingParams(), 0.0, priority=-3)[0].priority == -3
    with pytest.raises(ParamError):
        ranked.make_requests("r", prompt, SamplingParams(), 0.0, priority=2**63)


def test_scheduling_policy_is_an_engine_argument():
    from keel.config import ConfigError, SchedulerConfig
    from keel.engine_args import EngineArgs

    assert EngineArgs(scheduling_policy="priority").resolve()[0]["scheduling_policy"] == "priority"
    with pytest.raises(ConfigError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="lifo")
