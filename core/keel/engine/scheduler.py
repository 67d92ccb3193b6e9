"""The scheduler: one token budget per step, running requests first, then waiting ones.

`schedule()` decides and returns a plain `SchedulerOutput`; `update_from_output()` applies what the
runner produced (new tokens, stops, frees). There are no prefill/decode phases: every request has
`num_computed_tokens` catching up to its token count, so chunked prefill, prefix-cache hits, resumption
after preemption and speculative tokens are the same arithmetic.

With `async_scheduling` the engine core schedules step N+1 before it has applied step N's output: a
request whose step N samples a token carries an output placeholder until `update_from_output` sees the
token, and step N+1 already computes the placeholder position (the runner feeds it the sampled token
on the device). A request whose placeholders will finish it (max_tokens, max_model_len) is not
scheduled again; one that stops on a token wastes at most one step's slot, never a wrong token.
With speculative decoding too, step N's placeholders are 1 + its drafts (all counted as accepted, and
num_computed_tokens with them); step N+1 verifies k placeholder drafts (-1) that the runner takes from
step N's device output, and `update_from_output` rolls back the rejected ones when N arrives.

Structured outputs: a constrained request waits in the queue until its grammar has compiled (other
requests pass it), and each step that samples for it carries its allowed tokens (`grammar_bitmask`, a
`GrammarBitmask` filled off the loop). Its grammar must have seen every earlier token before the fill:
with `constrained_in_flight` (async scheduling, the runner in this process) a constrained request is
scheduled while its token is in flight, and its step's fill starts when `update_from_output` has
applied the step before; otherwise it is not scheduled while a token is in flight (it samples every
other step) and the fill starts at once.

Policies (vLLM's): "fcfs" serves and preempts in arrival order. "priority" keeps both the waiting queue
and the running list ordered by (priority, arrival), so the waiting request admitted next is the most
urgent one and the request preempted is always the least urgent running one (the last).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from keel.engine.core_output import EngineCoreOutput, SchedulerStats
from keel.engine.request import EngineCoreRequest, Request, RequestStatus
from keel.engine.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from keel.kv_cache.manager import KVCacheManager
from keel.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("keel.engine")


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        num_spec_tokens: int = 0,
        async_scheduling: bool = False,
        structured_output: StructuredOutputManager | None = None,
        scheduling_policy: str = "fcfs",
        pipeline_depth: int = 1,
        constrained_in_flight: bool = False,
    ) -> None:
        if pipeline_depth > 1 and num_spec_tokens:
            raise ValueError("pipelined scheduling (micro-batches) does not support speculative decoding")
        if scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {scheduling_policy!r}: fcfs or priority")
        if pipeline_depth > 1 and not async_scheduling:
            raise ValueError("pipelined scheduling (micro-batches) runs with async scheduling")
        if constrained_in_flight and (not async_scheduling or pipeline_depth > 1):
            raise ValueError("constrained_in_flight needs async scheduling with one step in flight")
        self.by_priority = scheduling_policy == "priority"
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.num_spec_tokens = num_spec_tokens
        self.async_scheduling = async_scheduling
        self.structured_output = structured_output
        # Async scheduling: a constrained request's next step is scheduled before its token arrived; that
        # step's bitmask is filled once update_from_output applied it (the fills waiting for that here).
        self.constrained_in_flight = constrained_in_flight
        self._fills_after_apply: list = []
        # ... unless the engine core gave the launched step's tokens (`launched`): its constrained requests'
        # grammars then advance on the fill thread as the tokens land, and the next fill queues behind.
        self._advances: dict[int, Future] = {}  # id(SchedulerOutput) -> {req_id: (accepted, ended)}
        self._advancing: frozenset[str] = frozenset()  # the requests the last launched step advances
        # Pipeline parallelism: `pipeline_depth` steps in flight are micro-batches of disjoint requests (a
        # request whose sampled token has not arrived waits: the first stage needs it), each taking about
        # 1 / depth of the running requests, and cached requests carry the tokens the runner has not seen
        # (`CachedRequestData.new_token_ids`).
        self.pipeline_depth = pipeline_depth
        self.pipelined = pipeline_depth > 1
        self._runner_num_tokens: dict[str, int] = {}  # pipelined: tokens each request's runner mirror holds

        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests the runner must forget at the next step (finished / aborted / preempted).
        self._forget: set[str] = set()
        # Requests already sent to the runner (so later steps send only the delta).
        self._known_to_runner: set[str] = set()
        # Outputs decided outside a step (a constraint that failed to compile), reported by the next apply.
        self._pending_outputs: list[EngineCoreOutput] = []
        self.stats = SchedulerStats()

    # ---------------------------------------------------------------- requests in and out

    def add_request(self, req: EngineCoreRequest, max_tokens: int) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        request = Request(req, max_tokens)
        constraint = req.sampling_params.structured_outputs
        if constraint is not None:
            if self.structured_output is None:
                raise ValueError("structured_outputs needs a structured_output backend plugin; none is loaded")
            request.structured_output = self.structured_output.add_request(constraint)
        self.requests[request.request_id] = request
        if self.by_priority:
            bisect.insort(self.waiting, request, key=_priority_key)
        else:
            self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Finish the named requests now and free their blocks; unknown ids are ignored."""
        outputs = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            outputs.append(EngineCoreOutput(rid, [], finish_reason="abort"))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---------------------------------------------------------------- decide

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs = CachedRequestData()
        spec_tokens: dict[str, list[int]] = {}
        scheduled: list[Request] = []  # in num_scheduled's order
        preempted_any = False

        # Running requests first, in arrival order; the last one is preempted when blocks run out.
        # Hoisted: at hundreds of decoding requests per step the per-request lookups are the cost.
        running, allocate_slots = self.running, self.kv.allocate_slots
        max_model_len, spec_on = self.max_model_len, bool(self.num_spec_tokens)
        constrained_waits = not self.constrained_in_flight  # for its token in flight
        i = 0
        share = -(-len(running) // self.pipeline_depth)  # running requests one micro-batch takes
        while i < len(running) and budget > 0 and len(scheduled) < share:
            request = running[i]
            placeholders = request.num_output_placeholders
            if placeholders and (
                    self.pipelined or self._placeholders_finish(request)
                    or (constrained_waits and request.structured_output is not None)):
                i += 1
                continue
            # Without a draft proposer spec_token_ids is always empty.
            drafts = self._drafts_to_verify(request) if spec_on else request.spec_token_ids
            computed = request.num_computed_tokens
            with_placeholders = len(request.all_token_ids) + placeholders
            num_new = with_placeholders + len(drafts) - computed
            # Never compute past the model's length (drafts beyond it are pointless).
            num_new = min(num_new, budget, max_model_len - computed)
            if num_new <= 0:
                i += 1
                continue
            num_lookahead = max(0, computed + num_new - with_placeholders) if drafts else 0
            reserve = num_lookahead + self._draft_slots(computed + num_new) if spec_on else num_lookahead
            while True:
                blocks = allocate_slots(request, num_new - num_lookahead, num_lookahead_tokens=reserve)
                if blocks is not None:
                    break
                victim = running.pop()
                self._preempt(victim)
                preempted_any = True
                if victim is request:
                    break
            if blocks is None:
                break  # `request` itself was preempted; everything after it is gone too
            self._add_scheduled(request, num_new, blocks.get_block_ids() if blocks.blocks else [], new_reqs,
                                cached_reqs)
            num_scheduled[request.request_id] = num_new
            scheduled.append(request)
            if num_lookahead:
                spec_tokens[request.request_id] = drafts[:num_lookahead]
            budget -= num_new
            i += 1

        # Waiting requests, only if nothing was preempted this step (no thrashing).
        compiling: list[Request] = []  # constrained requests whose grammar is not ready: they keep their place
        while self.waiting and budget > 0 and not preempted_any and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.num_output_placeholders:
                break  # preempted with a token still in flight: resume once it has arrived
            if request.structured_output is not None and not self._constraint_ready(request):
                if request.is_finished:
                    continue
                compiling.append(self.waiting.popleft())
                continue
            if request.sampling_params.prompt_logprobs is None and request.pooling_params is None:
                computed_blocks, num_cached = self.kv.get_computed_blocks(request)
            else:  # every prompt position must be computed (its logprobs; the pooler sees every one)
                computed_blocks, num_cached = None, 0
            num_new = request.num_tokens - num_cached
            if num_new > budget and not self.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            blocks = self.kv.allocate_slots(
                request, num_new, num_new_computed_tokens=num_cached, new_computed_blocks=computed_blocks,
                num_lookahead_tokens=self._draft_slots(num_cached + num_new),
            )
            if blocks is None:
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            request.num_cached_tokens = num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            if self.by_priority:
                bisect.insort(self.running, request, key=_priority_key)
            else:
                self.running.append(request)
            self._add_scheduled(request, num_new, blocks.get_block_ids(), new_reqs, cached_reqs)
            num_scheduled[request.request_id] = num_new
            scheduled.append(request)
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            scheduled_spec_decode_tokens=spec_tokens,
            finished_req_ids=self._forget,
        )
        self._forget = set()
        # The scheduler assumes scheduled tokens will be computed; rejected drafts are rolled back in
        # update_from_output.
        constrained: list[Request] = []
        token_in_flight = False  # a constrained request's grammar will not have seen its previous token
        async_scheduling = self.async_scheduling
        for request in scheduled:
            request.num_computed_tokens += num_scheduled[request.request_id]
            # a pooling request samples nothing
            samples = (request.num_computed_tokens >= len(request.all_token_ids) + request.num_output_placeholders
                       and request.pooling_params is None)
            if not samples:
                continue
            if request.structured_output is not None:
                constrained.append(request)
                token_in_flight = token_in_flight or (request.num_output_placeholders > 0
                                                      and request.request_id not in self._advancing)
            if async_scheduling:
                # This step samples the next token, and accepts any of its drafts: all count as placeholders
                # (the optimistic count) until update_from_output sees how many were accepted.
                request.num_output_placeholders += 1 + (len(spec_tokens.get(request.request_id, ()))
                                                        if spec_tokens else 0)
        if constrained:
            plan = self.structured_output.plan_bitmask(
                [r.request_id for r in constrained], [r.structured_output.grammar for r in constrained],
                [spec_tokens.get(r.request_id, ()) for r in constrained] if spec_tokens else None)
            if token_in_flight:
                self._fills_after_apply.append(plan)
            else:
                plan.start()
            output.grammar_bitmask = plan
        return output

    def launched(self, scheduler_output: SchedulerOutput,
                 wait_sampled: Callable[[float], dict[str, int] | None]) -> None:
        """Called by the engine core right after it launched `scheduler_output` (constrained_in_flight
        only), with `wait_sampled(timeout)`: the step's {req_id: token} once on the host, from any thread.
        The step's constrained requests' grammars then advance on the fill thread the moment the tokens
        land (`StructuredOutputManager.plan_advance`), so the next step's fill starts at `schedule()`,
        queued behind that, rather than after `update_from_output` -- which reads the outcome."""
        plan = scheduler_output.grammar_bitmask
        self._advancing = frozenset()
        # A fill still waiting for update_from_output must run before this advance: it is not queued yet.
        if plan is None or not self.constrained_in_flight or self._fills_after_apply:
            return
        grammars = plan.grammars  # one row per request: no drafts with constrained_in_flight
        if grammars is None:
            grammars = [self.requests[rid].structured_output.grammar for rid in plan.req_ids]
        self._advances[id(scheduler_output)] = self.structured_output.plan_advance(plan.req_ids, grammars,
                                                                                   wait_sampled, plan)
        self._advancing = frozenset(plan.req_ids)

    def _constraint_ready(self, request: Request) -> bool:
        """Whether a waiting constrained request's grammar has compiled; one that failed is finished
        here (reported by the next `update_from_output`)."""
        so = request.structured_output
        if not so.is_ready():
            return False
        if so.error is None:
            return True
        logger.warning("request %s: its structured_outputs constraint failed to compile: %s",
                       request.request_id, so.error)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        self._pending_outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="abort"))
        return False

    def _placeholders_finish(self, request: Request) -> bool:
        """The tokens in flight already reach max_tokens or max_model_len: nothing more to compute."""
        placeholders = request.num_output_placeholders  # attributes, not properties: once per request and step
        return (len(request.output_token_ids) + placeholders >= request.max_tokens
                or len(request.all_token_ids) + placeholders >= self.max_model_len)

    def _drafts_to_verify(self, request: Request) -> list[int]:
        """The drafts a running request's next step verifies.

        With a sampled step of it still in flight (async scheduling), its drafts are not on the host yet:
        the runner proposed them on the device, so the step carries placeholders (-1, vLLM's) for as many
        as fit in max_model_len, counted against the optimistic placeholders (every draft accepted).
        """
        if not request.num_output_placeholders or not self.num_spec_tokens:
            return request.spec_token_ids
        # Within max_model_len, not cut at max_tokens (see _set_drafts).
        room = min(self.num_spec_tokens, self.max_model_len - request.num_tokens_with_placeholders)
        return [-1] * max(room, 0)

    def _draft_slots(self, num_tokens_after_step: int) -> int:
        """Slots reserved past this step's tokens while spec decoding is on (as vLLM's lookahead).

        A draft model (MTP) writes its own KV at the positions of the drafts it proposes after the step,
        before the target has computed them; those slots must exist. Never past max_model_len, where
        no draft is proposed. Lookahead slots are never hashed into the prefix cache.
        """
        return max(0, min(self.num_spec_tokens, self.max_model_len - num_tokens_after_step))

    def _add_scheduled(
        self,
        request: Request,
        num_new: int,
        new_block_ids: list[int],
        new_reqs: list[NewRequestData],
        cached_reqs: CachedRequestData,
    ) -> None:
        rid = request.request_id
        if rid in self._known_to_runner:
            cached_reqs.req_ids.append(rid)
            cached_reqs.new_block_ids.append(new_block_ids)
            cached_reqs.num_computed_tokens.append(request.num_computed_tokens)
            cached_reqs.after_in_flight_step.append(request.num_output_placeholders > 0)
            if self.pipelined:
                cached_reqs.new_token_ids.append(request.all_token_ids[self._runner_num_tokens[rid]:])
                self._runner_num_tokens[rid] = len(request.all_token_ids)
            return
        self._known_to_runner.add(rid)
        if self.pipelined:
            self._runner_num_tokens[rid] = len(request.all_token_ids)
        params = request.sampling_params
        stop_ids = set(params.stop_token_ids or ())
        if request.eos_token_id is not None and not params.ignore_eos:
            stop_ids.add(request.eos_token_id)
        new_reqs.append(
            NewRequestData(
                req_id=request.request_id,
                token_ids=list(request.all_token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                sampling_params=params,
                seed=request.seed,
                block_ids=self.kv.get_block_ids(request.request_id),
                num_computed_tokens=request.num_computed_tokens,
                stop_token_ids=frozenset(stop_ids),
                pooling_params=request.pooling_params,
            )
        )

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.stats.num_preemptions_total += 1
        self._drop_from_runner(request.request_id)
        if self.by_priority:
            bisect.insort_left(self.waiting, request, key=_priority_key)
        else:
            self.waiting.appendleft(request)

    def _drop_from_runner(self, request_id: str) -> None:
        if request_id in self._known_to_runner:
            self._known_to_runner.discard(request_id)
            self._runner_num_tokens.pop(request_id, None)
            self._forget.add(request_id)

    # ---------------------------------------------------------------- apply

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = self._pending_outputs
        self._pending_outputs = []
        requests, stats = self.requests, self.stats
        # Hoisted: at hundreds of requests per step the per-request lookups are the cost.
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        prompt_lps, lps, spec_ids = runner_output.prompt_logprobs, runner_output.logprobs, runner_output.spec_token_ids
        advance = self._advances.pop(id(scheduler_output), None)
        advanced = advance.result() if advance is not None else None  # grammars the fill thread advanced
        for rid, vector in runner_output.pooler_output.items():
            request = requests.get(rid)
            if request is None or request.is_finished:
                continue
            stats.prompt_tokens_total += request.num_prompt_tokens
            outputs.append(EngineCoreOutput(rid, [], finish_reason="stop", pooling_output=vector,
                                            first_scheduled_time=request.first_scheduled_time))
            self._finish(request, RequestStatus.FINISHED_STOPPED)
        running_status, finished_status = RequestStatus.RUNNING, RequestStatus.FINISHED_STOPPED
        for rid, generated in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = requests.get(rid)
            if request is None or request.status >= finished_status:
                continue  # aborted while the step ran, or stopped by an earlier step (async scheduling)
            drafts = spec_tokens.get(rid) if spec_tokens else None
            if generated and request.num_output_placeholders:
                request.num_output_placeholders -= 1 + (len(drafts) if drafts else 0)
            running = request.status is running_status  # not preempted while the step ran
            if drafts:
                num_accepted = max(0, len(generated) - 1)
                if running:  # a preempted request recomputes from 0 anyway
                    request.num_computed_tokens -= len(drafts) - num_accepted
                self._count_drafts(runner_output.num_verified_drafts.get(rid, len(drafts)), num_accepted)
                request.spec_token_ids = []

            first = not request.output_token_ids
            if first and generated:
                stats.prompt_tokens_total += request.num_prompt_tokens
                stats.prompt_tokens_cached_total += request.num_cached_tokens
            status = None
            num_new = 0
            for token in generated:
                request.append_output_token_ids(token)
                num_new += 1
                status = self._check_stop(request, token)
                if request.structured_output is not None:  # token by token: a grammar's end stops here
                    status = self._advance_grammar(request, token, advanced) or status
                if status is not None:
                    break
            stats.generation_tokens_total += num_new
            new_tokens = generated if num_new == len(generated) else generated[:num_new]

            prompt_lp = prompt_lps.get(rid) if prompt_lps else None
            if not num_new and prompt_lp is None:
                continue
            lp = lps.get(rid) if lps else None
            if lp is not None and num_new < len(generated):
                lp = tuple(x[:num_new] for x in lp)
            out = EngineCoreOutput(rid, new_tokens, lp, prompt_lp, None, None, request.num_cached_tokens,
                                   request.first_scheduled_time if first and num_new else None)
            if status is not None:
                self._finish(request, status)
                out.finish_reason = status.finish_reason
                out.stop_reason = request.stop_reason
            elif running and spec_ids:
                self._set_drafts(request, spec_ids.get(rid))
            outputs.append(out)
        # The step scheduled after this one (one in flight) may fill its bitmask now: its grammars have
        # seen every token before it (a finished request's row is filled too; nothing reads its sample).
        for plan in self._fills_after_apply:
            plan.start()
        self._fills_after_apply = []
        return outputs

    def _count_drafts(self, num_drafts: int, num_accepted: int) -> None:
        if not num_drafts:
            return
        stats = self.stats
        stats.spec_decode_num_draft_tokens_total += num_drafts
        stats.spec_decode_num_accepted_tokens_total += num_accepted
        stats.spec_decode_num_drafts_total += 1
        per_pos = stats.spec_decode_num_accepted_tokens_per_pos
        if len(per_pos) < num_drafts:
            per_pos.extend([0] * (num_drafts - len(per_pos)))
        for pos in range(num_accepted):
            per_pos[pos] += 1

    def _advance_grammar(self, request: Request, token: int,
                         advanced: dict[str, tuple[bool, bool]] | None) -> RequestStatus | None:
        """Feed a committed token to the request's grammar -- unless the fill thread already did
        (`advanced`: {req_id: (accepted, ended)} from `launched`; an entry is used once). A grammar that has accepted its end stops the
        request (also with ignore_eos); a token it refuses (only possible when another mask banned every
        allowed token, e.g. min_tokens against a forced EOS) aborts it rather than emit invalid output."""
        outcome = advanced.pop(request.request_id, None) if advanced else None
        if outcome is None:
            grammar = request.structured_output.grammar
            outcome = grammar.accept_tokens([token]), grammar.is_terminated()
        accepted, ended = outcome
        if not accepted:
            logger.warning("request %s: token %s violates its structured_outputs constraint; aborting it",
                           request.request_id, token)
            return RequestStatus.FINISHED_ABORTED
        return RequestStatus.FINISHED_STOPPED if ended else None

    def _set_drafts(self, request: Request, drafts: list[int] | None) -> None:
        """Keep the drafts the next step can verify: within max_model_len, and what a constrained
        request's grammar accepts. Not cut at max_tokens (as vLLM): a request near its end verifies as
        many drafts as the others, so the batch keeps one query length and its CUDA graph (a shorter
        query made the whole step eager: 30-70 ms at batch 32 on DSV2-Lite against 13), and what is
        accepted past max_tokens is dropped by the stop check in `update_from_output`."""
        if not drafts:
            return
        room = min(self.max_model_len - request.num_tokens, self.num_spec_tokens)
        drafts = list(drafts[: max(room, 0)])
        if request.structured_output is not None and drafts:
            drafts = request.structured_output.grammar.validate_tokens(drafts)
        request.spec_token_ids = drafts

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if token == request.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_output >= request.max_tokens or len(request.all_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        self._drop_from_runner(request.request_id)
        self.stats.num_finished_total[status.finish_reason] = (
            self.stats.num_finished_total.get(status.finish_reason, 0) + 1
        )
        del self.requests[request.request_id]

    # ---------------------------------------------------------------- observe

    def make_stats(self) -> SchedulerStats:
        s = self.stats
        s.num_running_reqs = len(self.running)
        s.num_waiting_reqs = len(self.waiting)
        if self.structured_output is not None:  # waiting for their grammar, not for capacity
            s.num_waiting_deferred = sum(1 for r in self.waiting
                                         if r.structured_output is not None and not r.structured_output.is_ready())
        s.kv_cache_usage = self.kv.usage
        s.prefix_cache_queries_total = self.kv.prefix_cache_queries_total
        s.prefix_cache_hits_total = self.kv.prefix_cache_hits_total
        return s


def _priority_key(request: Request) -> tuple[int, float]:
    return request.priority_key
