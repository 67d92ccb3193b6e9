"""The scheduler's side of structured outputs with a fake backend (no grammar library): a compiling
request waits while others run, the bitmask covers exactly the rows that sample, grammars advance with
committed tokens and stop the request when they end, a failed compile aborts only its request, and the
front end refuses constraints it cannot enforce."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from keel.engine.processor import Processor
from keel.engine.request import EngineCoreRequest
from keel.engine.sampling_params import SamplingParams
from keel.engine.scheduler import Scheduler
from keel.engine.scheduler_output import ModelRunnerOutput
from keel.kv_cache.manager import KVCacheManager
from keel.kv_cache.spec import FullAttentionSpec
from keel.structured_output.backend import BackendContext
from keel.structured_output.manager import StructuredOutputManager
from keel.structured_output.params import StructuredOutputsParams

VOCAB, EOS = 40, 2
release = threading.Event()


class SequenceGrammar:
    """Accepts exactly the tokens of `regex` (digits separated by spaces), then EOS."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.pos = tokens + [EOS], 0

    def accept_tokens(self, tokens):
        if list(tokens) != self.tokens[self.pos : self.pos + len(tokens)]:
            return False
        self.pos += len(tokens)
        return True

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0
        t = self.tokens[self.pos]
        bitmask[row, t // 32] = 1 << (t % 32)

    def is_terminated(self):
        return self.pos == len(self.tokens)

    def validate_tokens(self, tokens):
        n = 0
        while n < len(tokens) and self.pos + n < len(self.tokens) and tokens[n] == self.tokens[self.pos + n]:
            n += 1
        return list(tokens[:n])

    def rollback(self, num_tokens):
        self.pos -= num_tokens


class FakeBackend:
    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx

    @classmethod
    def validate(cls, params):
        if params.regex == "invalid":
            raise ValueError("structured_outputs.regex is invalid: nope")

    def compile(self, params):
        if params.regex == "slow":
            release.wait(10)
            return [7]
        if params.regex == "fail":
            raise RuntimeError("[12:00:00] x.cc:1: exploded")
        return [int(t) for t in params.regex.split()]

    def grammar(self, compiled):
        return SequenceGrammar(compiled)


def make_scheduler(**kw) -> Scheduler:
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=4, dtype=torch.float32)
    manager = StructuredOutputManager(lambda: FakeBackend, lambda: BackendContext(None, VOCAB, EOS), VOCAB)
    return Scheduler(KVCacheManager(spec, num_blocks=64), max_num_seqs=8, max_num_batched_tokens=kw.pop("budget", 64),
                     max_model_len=64, structured_output=manager, **kw)


def add(s: Scheduler, rid: str, regex: str | None, n_prompt: int = 3, **params) -> None:
    sp = SamplingParams(max_tokens=10, structured_outputs={"regex": regex} if regex else None, **params)
    s.add_request(EngineCoreRequest(rid, list(range(10, 10 + n_prompt)), sp, EOS, seed=0), sp.max_tokens)


def run_step(s: Scheduler, pick):
    """One step: the runner 'samples' pick(req_id, allowed token set) for every request that samples."""
    so = s.schedule()
    allowed = {}
    if so.grammar_bitmask is not None:
        bits = so.grammar_bitmask.bitmask
        for i, rid in enumerate(so.grammar_bitmask.req_ids):
            allowed[rid] = {t for t in range(VOCAB) if (int(bits[i, t // 32]) >> (t % 32)) & 1}
    ids = list(so.num_scheduled_tokens)
    sampled = [[pick(rid, allowed.get(rid))] if s.requests[rid].num_computed_tokens >= s.requests[rid].num_tokens
               else [] for rid in ids]
    outs = s.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled))
    return so, allowed, {o.request_id: o for o in outs}


def wait_ready(s: Scheduler, rid: str) -> None:
    deadline = time.monotonic() + 5
    while not s.requests[rid].structured_output.is_ready():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_bitmask_rows_and_termination_even_with_ignore_eos():
    s = make_scheduler(budget=2)  # prompts of 3 tokens: the first step is a chunk that samples nothing
    add(s, "c", "5 6", ignore_eos=True)
    add(s, "free", None)
    wait_ready(s, "c")
    so, allowed, _ = run_step(s, lambda rid, ok: min(ok) if ok else 9)
    assert so.grammar_bitmask is None  # "c" computed 2 of 3 prompt tokens
    texts: dict[str, list[int]] = {"c": [], "free": []}
    for _ in range(6):
        so, allowed, outs = run_step(s, lambda rid, ok: min(ok) if ok else 9)
        for rid, out in outs.items():
            texts[rid] += out.new_token_ids
        if "c" in allowed:
            assert so.grammar_bitmask.req_ids == ["c"]
        if "c" in outs and outs["c"].finished:
            assert outs["c"].finish_reason == "stop"
            break
    assert texts["c"] == [5, 6, EOS]


def test_compiling_request_waits_while_others_run():
    release.clear()
    s = make_scheduler()
    add(s, "slow", "slow")
    add(s, "free", None)
    so, _, _ = run_step(s, lambda rid, ok: 9)
    assert list(so.num_scheduled_tokens) == ["free"] and [r.request_id for r in s.waiting] == ["slow"]
    assert s.make_stats().num_waiting_deferred == 1  # vLLM's num_requests_waiting_by_reason{reason="deferred"}
    release.set()
    wait_ready(s, "slow")
    assert s.make_stats().num_waiting_deferred == 0
    so, allowed, _ = run_step(s, lambda rid, ok: min(ok) if ok else 9)
    assert "slow" in so.num_scheduled_tokens and allowed["slow"] == {7}


def test_failed_compile_aborts_only_that_request():
    s = make_scheduler()
    add(s, "bad", "fail")
    add(s, "ok", "4")
    wait_ready(s, "bad")
    wait_ready(s, "ok")
    _, _, outs = run_step(s, lambda rid, ok: min(ok))
    assert outs["bad"].finish_reason == "abort" and "bad" not in s.requests
    assert outs["ok"].new_token_ids == [4]


def test_a_token_the_grammar_refuses_aborts_the_request():
    s = make_scheduler()
    add(s, "c", "4 4")
    wait_ready(s, "c")
    _, _, outs = run_step(s, lambda rid, ok: 9)  # as if another mask had banned every allowed token
    assert outs["c"].finish_reason == "abort"


def test_async_scheduling_skips_a_constrained_request_with_a_token_in_flight():
    s = make_scheduler(async_scheduling=True)
    add(s, "c", "4 5")
    add(s, "free", None)
    wait_ready(s, "c")
    first = s.schedule()
    second = s.schedule()  # step 1 not applied yet: "c"'s grammar has not seen its token
    assert set(first.num_scheduled_tokens) == {"c", "free"} and list(second.num_scheduled_tokens) == ["free"]


def allowed(so, rid: str) -> set[int]:
    bits = so.grammar_bitmask.bitmask
    i = so.grammar_bitmask.req_ids.index(rid)
    return {t for t in range(VOCAB) if (int(bits[i, t // 32]) >> (t % 32)) & 1}


def test_constrained_in_flight_schedules_every_step_and_fills_after_the_apply():
    """Async scheduling with the runner in-process: step N+1 is scheduled before step N's token arrived;
    its bitmask is filled only once update_from_output applied step N (the grammar saw that token)."""
    s = make_scheduler(async_scheduling=True, constrained_in_flight=True)
    add(s, "c", "4 5")
    add(s, "free", None)
    wait_ready(s, "c")
    steps = [s.schedule()]  # the prompt: no token in flight, so its fill starts at once
    assert allowed(steps[0], "c") == {4}
    tokens = iter([4, 5, EOS])
    outs: dict = {}
    while "c" not in outs or not outs["c"].finished:
        steps.append(s.schedule())  # launched before the previous step is applied
        assert set(steps[-1].num_scheduled_tokens) == {"c", "free"}
        plan = steps[-1].grammar_bitmask
        assert not plan.done()
        with pytest.raises(RuntimeError, match="before its fill started"):
            plan.result()
        done = steps[-2]
        token = next(tokens)
        outs = {o.request_id: o for o in s.update_from_output(done, ModelRunnerOutput(
            req_ids=list(done.num_scheduled_tokens), sampled_token_ids=[[token], [9]]))}
        if not outs["c"].finished:  # the fill started with the apply: it sees the token just committed
            assert allowed(steps[-1], "c") == {4: {5}, 5: {EOS}}[token]
    assert outs["c"].finish_reason == "stop" and len(steps) == 4  # one step per token, none skipped
    # The last step computed one extra position of "c" (discarded): a terminated grammar's row allows all.
    assert len(allowed(steps[-1], "c")) == VOCAB
    s.update_from_output(steps[-1], ModelRunnerOutput(req_ids=list(steps[-1].num_scheduled_tokens),
                                                      sampled_token_ids=[[11], [9]]))
    assert "c" not in s.requests


def test_launched_steps_advance_their_grammars_on_the_fill_thread_as_the_tokens_land():
    """With the step's tokens handed over at launch (`launched`), the fill thread advances the grammars
    as soon as the tokens are on the host -- not before -- so the next step's fill starts at schedule(),
    queued behind that; update_from_output reads the outcome (the grammar's end stops the request even
    when the next advance already ran) instead of advancing them again."""
    import threading

    s = make_scheduler(async_scheduling=True, constrained_in_flight=True)
    add(s, "c", "4 5")
    add(s, "free", None)
    wait_ready(s, "c")
    grammar = s.requests["c"].structured_output.grammar
    tokens = iter([4, 5, EOS, 11])
    outs: dict = {}
    done = None  # (step, its tokens, "on the host" event)
    steps = 0
    while not outs.get("c") or not outs["c"].finished:
        so = s.schedule()
        steps += 1
        if done is not None:  # a token in flight, yet the fill starts now: queued behind its advance
            assert so.grammar_bitmask._future is not None
            if not done[2].is_set():  # the token is not on the host yet: neither the advance nor the fill ran
                time.sleep(0.05)
                assert not so.grammar_bitmask.done() and grammar.pos == steps - 2
        landed = threading.Event()
        step_tokens = {"c": next(tokens), "free": 9}

        def wait_sampled(timeout, landed=landed, step_tokens=step_tokens):
            return step_tokens if landed.wait(timeout) else None

        s.launched(so, wait_sampled)
        if done is not None:
            prev, prev_tokens, prev_landed = done
            prev_landed.set()  # the previous step's tokens reach the host: advance, then this step's fill
            expected = {4: {5}, 5: {EOS}, EOS: set(range(VOCAB))}[prev_tokens["c"]]
            assert allowed(so, "c") == expected
            if step_tokens["c"] == EOS:  # this step's token lands (and ends the grammar) before the apply
                landed.set()             # of the previous one, which must not stop the request yet
                deadline = time.monotonic() + 5
                while not grammar.is_terminated():
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
            outs = {o.request_id: o for o in s.update_from_output(prev, ModelRunnerOutput(
                req_ids=list(prev.num_scheduled_tokens),
                sampled_token_ids=[[prev_tokens[r]] for r in prev.num_scheduled_tokens]))}
            assert outs["c"].new_token_ids == [prev_tokens["c"]]
            assert outs["c"].finished == (prev_tokens["c"] == EOS)
        done = so, step_tokens, landed
    assert outs["c"].finish_reason == "stop" and grammar.is_terminated()
    assert steps == 4 and not s._advances.keys() - {id(done[0])}


def test_a_bitmask_buffer_is_reused_once_its_step_sampled():
    """A step's advance runs once its tokens are on the host, so its sampling -- and the runner's copy of
    its bitmask -- is done: the buffer goes to a later fill (no 4 MB pinned allocation per step), and
    reading the old plan afterwards is an error rather than another step's rows."""
    s = make_scheduler(async_scheduling=True, constrained_in_flight=True)
    add(s, "c", "4 5 6")
    wait_ready(s, "c")
    first = s.schedule()
    buffer = first.grammar_bitmask.result()  # the runner reads it before sampling
    s.launched(first, lambda timeout: {"c": 4})
    second = s.schedule()  # its fill is queued behind the advance
    assert allowed(second, "c") == {5}
    assert second.grammar_bitmask.result().data_ptr() == buffer.data_ptr()
    with pytest.raises(RuntimeError, match="after its step's tokens"):
        first.grammar_bitmask.result()
    unread = s.structured_output.plan_bitmask(["c"], [s.requests["c"].structured_output.grammar])
    s.structured_output._recycle(unread)  # a plan nobody read keeps its bitmask
    unread.start()
    assert unread.result().shape == (1, 2)


def test_bitmask_travels_to_another_process_filled():
    import pickle

    s = make_scheduler()
    add(s, "c", "7")
    wait_ready(s, "c")
    so = pickle.loads(pickle.dumps(s.schedule()))
    assert so.grammar_bitmask.done() and allowed(so, "c") == {7}


def test_front_end_refusals():
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="invalid"))
    base = {"tokenizer": object(), "max_model_len": 64, "vocab_size": VOCAB, "eos_token_id": EOS}
    with pytest.raises(ValueError, match="backend plugin"):
        Processor(**base).check_structured_outputs(params)
    with pytest.raises(ValueError, match="regex is invalid: nope"):
        Processor(**base, structured_output_backend=lambda: FakeBackend).check_structured_outputs(params)
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams(structured_outputs={"regexx": "a"})


def allowed_rows(so) -> list[tuple[str, set[int] | None]]:
    """(request, allowed tokens or None for "everything") per bitmask row."""
    bits = so.grammar_bitmask.bitmask
    out = []
    for i, rid in enumerate(so.grammar_bitmask.req_ids):
        ok = {t for t in range(VOCAB) if (int(bits[i, t // 32]) >> (t % 32)) & 1}
        out.append((rid, None if len(ok) == VOCAB else ok))
    return out


def test_drafts_are_cut_to_the_grammar_and_every_verify_row_is_masked():
    s = make_scheduler(num_spec_tokens=3)
    add(s, "c", "5 6 7", n_prompt=3)
    wait_ready(s, "c")
    so = s.schedule()  # the prompt; the proposer drafts [6, 9, 7] after the first token 5
    s.update_from_output(so, ModelRunnerOutput(req_ids=["c"], sampled_token_ids=[[5]],
                                               spec_token_ids={"c": [6, 9, 7]}))
    assert s.requests["c"].spec_token_ids == [6]  # 9 is refused by the grammar: 7 after it is moot
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {"c": [6]}
    assert allowed_rows(so) == [("c", {6}), ("c", {7})]  # one row per verify position
    assert s.requests["c"].structured_output.grammar.pos == 1  # the tentative advance is rolled back
    # Draft 6 accepted, bonus 7; then drafts [EOS, 3]: the grammar ends at EOS, so 3 is cut.
    s.update_from_output(so, ModelRunnerOutput(req_ids=["c"], sampled_token_ids=[[6, 7]],
                                               spec_token_ids={"c": [EOS, 3]}))
    assert s.requests["c"].spec_token_ids == [EOS]
    so = s.schedule()
    assert allowed_rows(so) == [("c", {EOS}), ("c", None)]  # past the grammar's end: unconstrained
    outs = s.update_from_output(so, ModelRunnerOutput(req_ids=["c"], sampled_token_ids=[[EOS, 11]]))
    assert outs[0].new_token_ids == [EOS] and outs[0].finish_reason == "stop"  # nothing after the end


def test_the_manager_lowers_the_gil_switch_interval_while_it_lives():
    """The fill thread must not wait CPython's default 5 ms for the GIL each time it wakes or its batch
    fill returns while the engine loop runs Python; shutdown restores the process's setting."""
    import sys

    from keel.structured_output.manager import FILL_SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        manager = StructuredOutputManager(lambda: FakeBackend, lambda: BackendContext(None, VOCAB, EOS), VOCAB)
        assert sys.getswitchinterval() == pytest.approx(FILL_SWITCH_INTERVAL_S)
        manager.shutdown()
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(before)


def test_an_advance_waiting_for_tokens_that_never_land_does_not_block_exit():
    """An engine dropped without shutdown may leave the fill thread waiting for a step's tokens that are
    never enqueued; the interpreter joins that thread at exit, so the wait must end there."""
    import subprocess
    import sys

    code = ("import time\nfrom keel.structured_output.manager import StructuredOutputManager\n"
            "m = StructuredOutputManager(lambda: None, lambda: None, 64)\n"
            "m.plan_advance(['a'], [None], lambda timeout: time.sleep(timeout))\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
