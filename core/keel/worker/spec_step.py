"""SpecStepRunner: the model runner's step while speculative decoding is on (every step verifies).

Per step: inputs as any step, but each sampling request's last 1 + d tokens are its last token and d
drafts; logits at all of those rows are sampled with the state a plain step would have there (exact
coupling, `spec_decode/proposer.py`) and, on the device, the leading drafts equal to their samples are
accepted and the next sample is emitted; the proposer drafts for the next step; a `SpecLaunch` holds
the results until `get_output` copies them to the host.

Async scheduling (vLLM v1's scheme): step N+1 is scheduled before step N's accepted counts reach the host,
each request reserving 1 + k slots and counting N's drafts as accepted. A request whose step N is still
in flight (`CachedRequestData.after_in_flight_step`) gets its inputs from N's device tensors: its bonus
token and drafts into the input ids, its positions and sequence length lowered by N's rejected count,
slots recomputed from the block table, the sampler's seed counter advanced by N's emitted count -- no
host sync. The host path takes over, after waiting for step N, where the host must know N's tokens:
penalties, bad words and min_tokens read a request's outputs; a proposer without `propose_on_device`
(n-gram) reads token history; attention backends that are not graph-safe may read host sequence lengths.
A request then verifies only the drafts that exist (the scheduler counted placeholders: the missing
ones count as rejected).
"""

from __future__ import annotations

import numpy as np
import torch

from keel.attention.metadata import CommonAttentionMetadata
from keel.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from keel.layers.sampling_metadata import SamplingMetadata
from keel.spec_decode.proposer import DraftInput
from keel.worker.grammar_constraint import grammar_arrays, staged_constraint
from keel.worker.spec_launch import AsyncSpecOutput, SpecLaunch
from keel.worker.staging import pinned_empty, record_event


class SpecStepRunner:
    """Owned by the model runner when a proposer is configured; `execute` once per non-empty step."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.k = runner.num_speculative_tokens
        self.device = runner.device
        self.device_proposer = hasattr(runner.proposer, "propose_on_device")
        # Graph-safe backends never read exact host sequence lengths (they size launches from
        # max_seq_len); on the CPU the "device" tensors are the host's.
        self.device_fixups_ok = self.device.type == "cpu" or all(
            getattr(layer.backend, "supports_cuda_graph", False) for layer in runner.attn_layers)
        self.last: SpecLaunch | None = None
        self.pending: AsyncSpecOutput | None = None
        self.num_device_fixed = 0  # requests whose inputs came from a step still in flight (tests)
        self.num_host_fixed = 0  # requests corrected on the host (their previous step was committed)
        self.num_host_waits = 0  # steps that waited for the previous step's tokens first

    def wait(self) -> None:
        if self.pending is not None and not self.pending.is_done:
            self.num_host_waits += 1
            self.pending.get_output()

    def _needs_host_history(self, rows: np.ndarray) -> bool:
        b = self.runner.input_batch
        num_out = b.num_tokens[rows] - b.num_prompt_tokens[rows]
        return bool(b.uses_penalties[rows].any() or b.has_bad_words[rows].any()
                    or (b.min_tokens[rows] > num_out).any())

    # ---------------------------------------------------------------- step

    @torch.no_grad()
    def execute(self, so: SchedulerOutput) -> AsyncSpecOutput:
        r, k = self.runner, self.k
        batch = r.input_batch
        req_ids = list(so.num_scheduled_tokens)
        states = [r.requests[rid] for rid in req_ids]
        n = len(req_ids)
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=n)
        num_scheduled = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=n)
        cached = so.scheduled_cached_reqs
        after_ids = {rid for rid, after in zip(cached.req_ids, cached.after_in_flight_step) if after}
        after = np.fromiter((rid in after_ids for rid in req_ids), dtype=bool, count=n)
        if after.any() and (not self.device_proposer or not self.device_fixups_ok
                            or self._needs_host_history(rows[after])):
            self.wait()
        launch = self.last
        entries = np.full(n, -1, dtype=np.int64)
        device_fix = False
        if after.any():
            idx = np.flatnonzero(after)
            found = launch.entries(rows[idx]) if launch is not None else np.full(idx.shape[0], -1)
            if (found < 0).any():
                raise RuntimeError("internal: a request's in-flight step is not the runner's last launch")
            entries[idx] = found
            if launch.is_committed:  # the host knows step N: correct the scheduler's optimistic count here
                rejected = launch.rejected_host(found)
                batch.num_computed_tokens[rows[idx]] -= rejected
                for i, rej in zip(idx.tolist(), rejected.tolist()):
                    states[i].num_computed_tokens -= rej
                self.num_host_fixed += idx.shape[0]
            else:
                device_fix = True

        # The drafts each request verifies (-1: still on the device, in step N's launch).
        counted = np.zeros(n, dtype=np.int64)
        drafts: dict[int, list[int]] = {}
        verified: dict[str, int] = {}
        for i, rid in enumerate(req_ids):
            d = so.scheduled_spec_decode_tokens.get(rid)
            if not d:
                continue
            counted[i] = len(d)
            if d[0] >= 0 or device_fix:
                drafts[i] = list(d)
                continue
            known = launch.drafts_host[entries[i]][: len(d)] if launch.drafts_host is not None else []
            num_scheduled[i] -= len(d) - len(known)  # missing drafts count as rejected
            verified[rid] = len(known)
            if known:
                drafts[i] = known
        batch.ensure_len(int((batch.num_tokens[rows] + batch.num_in_flight[rows]).max()) + k + 2)
        for i, d in drafts.items():
            batch.write_drafts(int(rows[i]), d)
        step = batch.prepare_inputs(rows, num_scheduled)
        qsl = step.query_start_loc.astype(np.int64)

        counts = step.num_sample_rows
        sampling_idx = np.flatnonzero(counts)
        sc = counts[sampling_idx]
        firsts = np.cumsum(sc) - sc  # first logits row of each sampling request
        group = np.repeat(np.arange(sampling_idx.shape[0]), sc)
        num_rows = int(sc.sum())
        local = np.arange(num_rows) - firsts[group]
        sample_rows = (qsl[1:][sampling_idx] - sc)[group] + local
        draft_values = np.full(num_rows, -1, dtype=np.int64)  # row j compares with draft j; last: none
        for g, i in enumerate(sampling_idx.tolist()):
            d = drafts.get(i)
            if d:
                draft_values[firsts[g]: firsts[g] + len(d)] = d
        layout = np.full((n, 1 + k), num_rows, dtype=np.int64)  # logits rows per request, padded
        layout[sampling_idx[group], local] = np.arange(num_rows)
        has_sample = np.zeros(n, dtype=np.int64)
        has_sample[sampling_idx] = 1
        first_row = np.zeros(n, dtype=np.int64)
        first_row[sampling_idx] = firsts
        last_valid_base = qsl[1:] - 1
        last_valid_base[sampling_idx] = qsl[1:][sampling_idx] - sc
        tok_rows = np.repeat(rows, num_scheduled)
        nxt = step.positions + 1
        next_tokens = np.where(nxt < batch.num_tokens[tok_rows], batch.token_ids[tok_rows, nxt], 0)

        arrays = {
            "input_ids": step.input_ids, "positions": step.positions, "query_start_loc": step.query_start_loc,
            "seq_lens": step.seq_lens, "block_table": step.block_table, "slot_mapping": step.slot_mapping,
            "sample_rows": sample_rows, "draft_values": draft_values, "layout": layout, "has_sample": has_sample,
            "counted": counted, "last_valid_base": last_valid_base, "next_tokens": next_tokens,
            "drafting": sampling_idx.astype(np.int64), "num_blocks": batch.num_blocks[rows],
        }
        # Sampling parameters per logits row from the persistent batch, staged with the inputs (no pageable
        # copies: those would wait for the device); rows whose penalties, bans or min_tokens read their
        # outputs take SamplingMetadata.build with each verify row's exact history instead.
        verify_rows = rows[sampling_idx][group]
        fast = r.vocab_size is not None and not self._needs_host_history(rows[sampling_idx])
        if fast:
            for name, arr in r.sampling_state.host_arrays(batch, verify_rows, r.vocab_size).items():
                arrays["sampling." + name] = arr
            arrays["sampling.step"] = arrays["sampling.step"] + local  # row j follows j drafts
        if device_fix:
            arrays.update(self._fixup_arrays(launch, entries, after, num_scheduled, qsl, drafts, sampling_idx,
                                             group, firsts))
        grammar = so.grammar_bitmask
        arrays.update(grammar_arrays(grammar, [req_ids[i] for i in sampling_idx.tolist()], sc))
        t = r.staging.stage(arrays)
        input_ids, positions, seq_lens = t["input_ids"], t["positions"], t["seq_lens"]
        step_offset = None
        if device_fix:
            step_offset = self._apply_fixups(launch, t, input_ids, positions, seq_lens)
            self.num_device_fixed += int((entries >= 0).sum())
        common = CommonAttentionMetadata(
            query_start_loc=t["query_start_loc"], query_start_loc_cpu=torch.from_numpy(step.query_start_loc),
            seq_lens=seq_lens,
            # Under device fix-ups the host's lengths are upper bounds (graph-safe backends read none).
            seq_lens_cpu=seq_lens if self.device.type == "cpu" else torch.from_numpy(step.seq_lens),
            block_table=t["block_table"], slot_mapping=t["slot_mapping"], num_reqs=n,
            num_actual_tokens=int(step.input_ids.shape[0]), max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len, block_size=r.block_size,
        )
        hidden = r._forward(input_ids, positions, common, so)

        out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[] for _ in req_ids],
                                num_verified_drafts=verified)
        if hidden is not None and batch.wants_prompt_logprobs[rows].any():
            r._prompt_logprobs(so, req_ids, states, step.query_start_loc.tolist(), hidden, out)
        if num_rows == 0:  # prefill chunks only: the proposer still sees them (its KV cache)
            self._propose_device(states, t, hidden, positions, common, None, None)
            self.last = None
            return AsyncSpecOutput(out, None, self.commit)
        constraint = staged_constraint(grammar, t)
        result = self._sample(states, sampling_idx, sc, drafts, t, hidden, step_offset, constraint,
                              verify_rows if fast else None)
        sampled = result.sampled_token_ids  # [S] int64
        match = torch.cat([sampled == t["draft_values"], sampled.new_zeros(1, dtype=torch.bool)])
        accepted = match[t["layout"]].to(torch.int64).cumprod(dim=1).sum(dim=1)  # [n]
        has = t["has_sample"]
        num_emitted = (accepted + 1) * has  # [n]
        emitted = torch.cat([sampled, sampled.new_zeros(1)])[t["layout"]]  # [n, 1 + k]
        rejected = torch.cat([t["counted"] - accepted * has, has.new_zeros(1)])
        last_tokens = emitted.gather(1, (num_emitted - 1).clamp(min=0)[:, None]).squeeze(1)
        # A verify step the target replayed as a graph, every request sampling: the drafts replay too.
        draft_key = (r.cuda_graphs.last_key
                     if r.draft_graphs is not None and sampling_idx.shape[0] == n else None)
        new_drafts = self._propose_device(states, t, hidden, positions, common, accepted * has, sampled,
                                          draft_key)
        host_src = {"emitted": emitted, "num_emitted": num_emitted}
        if new_drafts is not None:
            host_src["drafts"] = new_drafts
        if result.logprobs is not None:
            host_src.update(lp_ids=result.logprob_token_ids, lp=result.logprobs, lp_ranks=result.ranks)
        host, event = self._to_host(host_src)
        launch = SpecLaunch(
            req_ids=req_ids, rows=rows, generations=batch.generation[rows].copy(), sampled=has_sample.astype(bool),
            num_drafts=counted, first_sample_row=first_row,
            num_logprobs=[s.sampling_params.logprobs for s in states], emitted=emitted, num_emitted=num_emitted,
            drafts=new_drafts, rejected=rejected, last_tokens=last_tokens, host=host, event=event,
        )
        for i in sampling_idx.tolist():
            batch.num_in_flight[rows[i]] += 1 + counted[i]
        self.last = launch
        self.pending = AsyncSpecOutput(out, launch, self.commit)
        if not self.device_proposer:  # the proposer reads committed token ids on the host
            self.pending.get_output()
            self._propose_host(so, states, step.query_start_loc.tolist(), hidden, out, launch)
        return self.pending

    def _fixup_arrays(self, launch, entries, after, num_scheduled, qsl, drafts, sampling_idx, group, firsts):
        """Index arrays that take step N's device results into this step (staged with its inputs)."""
        k = self.k
        fix = np.flatnonzero(after)
        pad = len(launch.req_ids)  # entry `pad` of launch.rejected is 0
        req_entry = np.full(entries.shape[0], pad, dtype=np.int64)
        req_entry[fix] = entries[fix]
        draft_dst, draft_src, draft_row = [], [], []
        row_of = {int(i): int(f) for i, f in zip(sampling_idx.tolist(), firsts.tolist())}
        for i in fix.tolist():
            m = len(drafts.get(i, ()))
            draft_dst.extend(range(int(qsl[i]) + 1, int(qsl[i]) + 1 + m))
            draft_src.extend(range(int(entries[i]) * k, int(entries[i]) * k + m))
            draft_row.extend(range(row_of[i], row_of[i] + m))
        return {
            "fix_tok_entry": np.repeat(req_entry, num_scheduled), "fix_req_entry": req_entry,
            "fix_req_index": np.repeat(np.arange(entries.shape[0]), num_scheduled),
            "fix_bonus_dst": qsl[fix], "fix_bonus_src": entries[fix],
            "fix_draft_dst": np.asarray(draft_dst, dtype=np.int64), "fix_draft_src": np.asarray(draft_src, dtype=np.int64),
            "fix_draft_row": np.asarray(draft_row, dtype=np.int64),
            "fix_step_entry": req_entry[sampling_idx][group],
        }

    def _apply_fixups(self, launch: SpecLaunch, t, input_ids, positions, seq_lens) -> torch.Tensor:
        """Correct this step's inputs on the device from step N's launch; returns the seed-counter offset
        of each logits row ([S] int64: step N's emitted tokens the host has not counted)."""
        bs = self.runner.block_size
        positions.sub_(launch.rejected.index_select(0, t["fix_tok_entry"]))
        seq_lens.sub_(launch.rejected.index_select(0, t["fix_req_entry"]).to(seq_lens.dtype))
        table = t["block_table"]
        blocks = table[t["fix_req_index"], positions // bs].to(torch.int64)
        t["slot_mapping"].copy_(blocks * bs + positions % bs)
        input_ids.index_copy_(0, t["fix_bonus_dst"], launch.last_tokens.index_select(0, t["fix_bonus_src"]))
        if t["fix_draft_dst"].shape[0]:
            values = launch.drafts.reshape(-1).index_select(0, t["fix_draft_src"])
            input_ids.index_copy_(0, t["fix_draft_dst"], values.clamp(min=0))
            t["draft_values"].index_copy_(0, t["fix_draft_row"], values)
        emitted = torch.cat([launch.num_emitted, launch.num_emitted.new_zeros(1)])
        return emitted.index_select(0, t["fix_step_entry"])

    def _sample(self, states, sampling_idx, sc, drafts, t, hidden, step_offset, constraint, verify_rows):
        """Sample every verify row; row j of a request with the state after its j drafts. verify_rows
        ([S] InputBatch rows): parameters from the persistent batch, staged; None: SamplingMetadata.build
        from each row's outputs and drafts (placeholder -1 drafts occur only where no row reads them)."""
        r = self.runner
        logits = r.model.compute_logits(hidden[t["sample_rows"]])  # [S, vocab]
        vocab = logits.shape[-1]
        if r.vocab_size is None:
            r.vocab_size = vocab
        elif vocab != r.vocab_size:
            raise RuntimeError(f"the model's logits have {vocab} columns, expected {r.vocab_size}")
        if verify_rows is not None:
            staged = {name[9:]: x for name, x in t.items() if name.startswith("sampling.")}
            meta = r.sampling_state.build(r.input_batch, verify_rows, vocab, staged=staged)
            return self._finish_sampling(logits, meta, step_offset, constraint)
        params, outputs, prompts, seeds, stops = [], [], [], [], []
        for i, num in zip(sampling_idx.tolist(), sc.tolist()):
            state = states[i]
            prior, d = state.output_token_ids, drafts.get(i, ())
            for j in range(num):
                params.append(state.sampling_params)
                outputs.append(prior + list(d[:j]) if j else prior)
                prompts.append(state.prompt_token_ids)
                seeds.append(state.seed)
                stops.append(state.stop_token_ids)
        meta = SamplingMetadata.build(params=params, output_token_ids=outputs, prompt_token_ids=prompts,
                                      seeds=seeds, vocab_size=vocab, device=self.device,
                                      stop_token_ids_for_min_tokens=stops)
        return self._finish_sampling(logits, meta, step_offset, constraint)

    def _finish_sampling(self, logits, meta, step_offset, constraint):
        if step_offset is not None:  # the emitted tokens of step N the host has not counted
            meta.step = meta.step + step_offset
        if constraint is not None:  # waits for the bitmask's fill if it is still running (host side)
            logits = self.runner.token_bitmask(logits, *constraint.on_device(self.device))
        return self.runner.sampler(logits, meta)

    def _propose_device(self, states, t, hidden, positions, common, accepted, sampled, draft_key=None):
        """Drafts [n, k] on the device (None for a host proposer or a step that sampled nothing).

        accepted: [n] int64 accepted drafts (0 where nothing was sampled); sampled: [S] the logits rows'
        samples; draft_key: the target graph this step replayed, when the drafts may replay theirs. The
        proposer sees every computed position: rows up to each request's last accepted one have their
        next token committed (a sample, or a prompt token)."""
        r = self.runner
        if not self.device_proposer or hidden is None:
            return None
        n = len(states)
        last_valid = t["last_valid_base"] if accepted is None else t["last_valid_base"] + accepted
        next_tokens = t["next_tokens"]
        if sampled is not None:  # a sampling row's next token is its sample
            next_tokens.index_copy_(0, t["sample_rows"], sampled)
        if draft_key is not None:  # worker/draft_graph.py
            drafts = r.draft_graphs.run(draft_key, n, next_tokens, last_valid, t["num_blocks"])
            if drafts is not None:
                return drafts
        batch = DraftInput(
            req_ids=[s.req_id for s in states], token_ids=[s.token_ids for s in states],
            max_drafts=[0] * n, hidden_states=hidden, block_ids=[s.block_ids for s in states],
            block_size=r.block_size, kv_caches=r.kv_caches, positions=positions, next_token_ids=next_tokens,
            last_valid_rows=last_valid, attn_metadata=common, drafting=t["drafting"],
            num_blocks=t["num_blocks"], max_model_len=r.max_model_len or (1 << 40),
        )
        drafts = r.proposer.propose_on_device(batch)
        return drafts if sampled is not None else None

    def _to_host(self, tensors: dict[str, torch.Tensor]):
        if self.device.type == "cpu":
            return dict(tensors), None
        host = {name: pinned_empty(x.shape, x.dtype, self.device).copy_(x, non_blocking=True)
                for name, x in tensors.items()}
        return host, record_event(self.device)

    # ---------------------------------------------------------------- host side

    def commit(self, launch: SpecLaunch, out: ModelRunnerOutput) -> None:
        """The host learns a launch's tokens: the input batch and request mirrors of rows still held by
        the same requests get them; `out` gets every request's tokens, logprobs and next drafts."""
        r, batch = self.runner, self.runner.input_batch
        host = launch.host
        num_emitted = host["num_emitted"].numpy().copy()
        emitted = host["emitted"].tolist()
        if "drafts" in host:
            launch.drafts_host = [[x for x in row if x >= 0] if s else [] for row, s in
                                  zip(host["drafts"].tolist(), launch.sampled.tolist())]
        launch.num_emitted_host = num_emitted
        lps = None
        if "lp" in host:
            lps = (host["lp_ids"].tolist(), host["lp"].tolist(), host["lp_ranks"].tolist())
        same = batch.generation[launch.rows] == launch.generations
        for e, rid in enumerate(launch.req_ids):
            if not launch.sampled[e]:
                continue
            tokens = emitted[e][: num_emitted[e]]
            out.sampled_token_ids[e] = tokens
            row = int(launch.rows[e])
            state = r.requests.get(rid) if same[e] else None
            if state is not None and state.row == row:
                state.token_ids.extend(tokens)
                batch.append_tokens(row, tokens)
                batch.num_in_flight[row] -= 1 + launch.num_drafts[e]
            if launch.drafts_host is not None and launch.drafts_host[e]:
                out.spec_token_ids[rid] = launch.drafts_host[e]
            k = launch.num_logprobs[e]
            if k is not None and lps is not None:
                f = int(launch.first_sample_row[e])
                out.logprobs[rid] = tuple([x[: k + 1] for x in col[f: f + len(tokens)]] for col in lps)

    def _propose_host(self, so, states, query_start, hidden, out, launch: SpecLaunch) -> None:
        """A host proposer (n-gram) after the step's tokens are committed; its drafts go to `out` and
        to the launch (the next step's placeholders read them)."""
        r = self.runner
        sampled = set(np.flatnonzero(launch.sampled).tolist())
        first_pos, valid, max_drafts = [], [], []
        for i, state in enumerate(states):
            start, num = state.num_computed_tokens, so.num_scheduled_tokens[state.req_id]
            first_pos.append(start)
            valid.append(min(start + num, len(state.token_ids) - 1) - start)
            room = self.k if i in sampled else 0
            if r.max_model_len is not None:
                room = min(room, r.max_model_len - len(state.token_ids))
            max_drafts.append(max(room, 0))
        batch = DraftInput(
            req_ids=[s.req_id for s in states], token_ids=[s.token_ids for s in states], max_drafts=max_drafts,
            hidden_states=hidden, last_hidden_rows=[query_start[i] + v - 1 for i, v in enumerate(valid)],
            first_positions=first_pos, first_rows=list(query_start[:-1]), num_valid_positions=valid,
            block_ids=[s.block_ids for s in states], block_size=r.block_size, kv_caches=r.kv_caches,
        )
        proposed = [list(d) for d in r.proposer.propose(batch)]
        launch.drafts_host = proposed
        for state, d in zip(states, proposed):
            if d:
                out.spec_token_ids[state.req_id] = d
