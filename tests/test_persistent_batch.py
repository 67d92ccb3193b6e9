"""The runner's persistent input batch and per-row sampling state equal the per-step rebuilds they replace."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import torch

from keel.engine.sampling_params import SamplingParams
from keel.layers.sampler import Sampler
from keel.layers.sampling_metadata import SamplingMetadata
from keel.worker.input_batch import InputBatch
from keel.worker.sampling_batch import BatchSamplingState

BS = 4
VOCAB = 50


def _reference_inputs(reqs, bs):
    """The loop the runner used to run: per request lists, then tensors."""
    token_ids, positions, qsl, seq_lens, slots = [], [], [0], [], []
    max_blocks = max(len(r["blocks"]) for r in reqs)
    table = np.zeros((len(reqs), max_blocks), dtype=np.int32)
    for i, r in enumerate(reqs):
        start, n = r["computed"], r["n"]
        seq = r["tokens"] + r["drafts"]
        token_ids += seq[start : start + n]
        positions += list(range(start, start + n))
        qsl.append(qsl[-1] + n)
        seq_lens.append(start + n)
        table[i, : len(r["blocks"])] = r["blocks"]
        slots += [r["blocks"][p // bs] * bs + p % bs for p in range(start, start + n)]
    return token_ids, positions, qsl, seq_lens, table, slots


def test_prepare_inputs_matches_per_request_loop_with_row_reuse_and_growth():
    rng = random.Random(0)
    batch = InputBatch(BS, max_num_reqs=2, max_model_len=8)  # forces row and column growth
    live: dict[str, dict] = {}
    next_block = 1
    for step in range(30):
        for rid in [r for r in live if rng.random() < 0.2]:  # some requests leave
            batch.remove_request(live.pop(rid)["row"])
        while len(live) < 5:  # new ones arrive (rows are reused)
            n_tok = rng.randint(1, 20)
            tokens = [rng.randrange(VOCAB) for _ in range(n_tok)]
            computed = rng.randint(0, n_tok - 1)
            blocks = list(range(next_block, next_block + -(-(n_tok + 3) // BS)))
            next_block += len(blocks)
            row = batch.add_request(tokens, n_tok, computed, blocks, SamplingParams(), 0, frozenset())
            live[f"r{step}-{len(live)}"] = {"row": row, "tokens": tokens, "computed": computed, "blocks": blocks}
        order = list(live)
        rng.shuffle(order)
        reqs = []
        for rid in order:
            r = live[rid]
            r["drafts"] = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 2))] if rng.random() < 0.3 else []
            r["n"] = max(1, min(len(r["tokens"]) + len(r["drafts"]) - r["computed"], rng.randint(1, 6)))
            need = -(-(r["computed"] + r["n"]) // BS) - len(r["blocks"])
            if need > 0:
                new = list(range(next_block, next_block + need))
                next_block += need
                r["blocks"] += new
                batch.append_block_ids(r["row"], new)
            if r["drafts"]:
                batch.write_drafts(r["row"], r["drafts"])
            reqs.append(r)
        rows = np.array([r["row"] for r in reqs], dtype=np.int64)
        got = batch.prepare_inputs(rows, np.array([r["n"] for r in reqs], dtype=np.int64))
        ids, pos, qsl, seq_lens, table, slots = _reference_inputs(reqs, BS)
        assert got.input_ids.tolist() == ids
        assert got.positions.tolist() == pos
        assert got.query_start_loc.tolist() == qsl
        assert got.seq_lens.tolist() == seq_lens
        # The width is padded to a multiple of 16 (one kernel variant per stride class); padding is 0.
        assert got.block_table.shape[1] % 16 == 0
        assert np.array_equal(got.block_table[:, : table.shape[1]], table)
        assert not got.block_table[:, table.shape[1]:].any()
        assert got.slot_mapping.tolist() == slots
        expected_rows = [max(r["computed"] + r["n"] - (len(r["tokens"]) - 1), 0) for r in reqs]
        assert got.num_sample_rows.tolist() == expected_rows
        for r in reqs:  # the step commits: computed advances, sampling requests get one token
            r["computed"] = min(r["computed"] + r["n"], len(r["tokens"]))
            batch.num_computed_tokens[r["row"]] = r["computed"]
            if r["computed"] == len(r["tokens"]):
                tok = rng.randrange(VOCAB)
                r["tokens"].append(tok)
                batch.append_sampled(np.array([r["row"]]), np.array([tok]))


def _random_params(rng: random.Random, i: int) -> SamplingParams:
    kw: dict = {"temperature": rng.choice([0.0, 0.7, 1.0]), "seed": i}
    if rng.random() < 0.5:
        kw.update(top_p=rng.choice([0.5, 1.0]), top_k=rng.choice([0, 5, 100]), min_p=rng.choice([0.0, 0.1]))
    if rng.random() < 0.5:
        kw.update(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    if rng.random() < 0.3:
        kw.update(min_tokens=3)
    if rng.random() < 0.2:
        kw.update(logit_bias={3: 2.0, 7: -1.0})
    if rng.random() < 0.3:
        kw.update(logprobs=rng.choice([0, 2]))
    return SamplingParams(**kw)


def test_sampling_state_matches_sampling_metadata_build_over_steps():
    rng = random.Random(1)
    batch = InputBatch(BS, max_num_reqs=4)
    state = BatchSamplingState(torch.device("cpu"))
    sampler = Sampler()
    reqs = []
    for i in range(10):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 9))]
        outputs = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 3))]
        params = _random_params(rng, i)
        stops = frozenset({2, 60})  # 60 is outside the vocabulary and is skipped
        row = batch.add_request(prompt + outputs, len(prompt), 0, [1], params, 1000 + i, stops)
        reqs.append({"row": row, "prompt": prompt, "out": outputs, "params": params, "seed": 1000 + i,
                     "stops": stops})
    for _ in range(6):
        chosen = rng.sample(reqs, 7)
        rows = np.array([r["row"] for r in chosen], dtype=np.int64)
        got = state.build(batch, rows, VOCAB)
        want = SamplingMetadata.build(
            params=[r["params"] for r in chosen], output_token_ids=[r["out"] for r in chosen],
            prompt_token_ids=[r["prompt"] for r in chosen], seeds=[r["seed"] for r in chosen],
            vocab_size=VOCAB, device="cpu", stop_token_ids_for_min_tokens=[r["stops"] for r in chosen],
        )
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalties", "frequency_penalties",
                     "repetition_penalties", "seeds", "step", "min_tokens_mask", "logit_bias"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert torch.equal(a, b), name
        for name in ("all_greedy", "all_random", "no_penalties", "no_top_k", "no_top_p", "no_min_p",
                     "max_num_logprobs", "vocab_size"):
            assert getattr(got, name) == getattr(want, name), name
        if not want.no_penalties:
            pen = torch.tensor([r["params"].repetition_penalty != 1.0 for r in chosen])
            assert torch.equal(got.output_token_counts[pen], want.output_token_counts[pen])
            assert torch.equal(got.prompt_token_mask[pen], want.prompt_token_mask[pen])
            assert not got.output_token_counts[~pen].any()
        logits = torch.randn(len(chosen), VOCAB)
        assert torch.equal(sampler(logits, got).sampled_token_ids, sampler(logits, want).sampled_token_ids)
        tokens = torch.randint(0, VOCAB, (len(chosen),))
        batch.append_sampled(rows, tokens.numpy())
        state.record_sampled(batch, rows, tokens)
        for r, t in zip(chosen, tokens.tolist()):
            r["out"].append(t)
        if rng.random() < 0.3:  # a step with drafts: counts are rebuilt from the tokens next time
            r = chosen[0]
            extra = [rng.randrange(VOCAB), rng.randrange(VOCAB)]
            batch.append_tokens(r["row"], extra)
            r["out"] += extra
            state.invalidate(np.array([r["row"]]))


def test_engine_fast_sampling_path_equals_general_path(tmp_path):
    """Penalties, seeds, min_tokens and logprobs through the engine: same tokens and logprobs whether the
    runner samples from the persistent batch or rebuilds SamplingMetadata every step."""
    from keel import LLM
    from keel.testing.checkpoints import make_checkpoint

    path = make_checkpoint("llama", tmp_path / "m", num_hidden_layers=1)
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(rng.randint(3, 20))]} for _ in range(6)]
    params = [SamplingParams(temperature=t, seed=i, presence_penalty=0.4, frequency_penalty=0.2,
                             repetition_penalty=1.3 if i % 2 else 1.0, min_tokens=2, logprobs=2, max_tokens=12)
              for i, t in enumerate([0.0, 0.8, 1.0, 0.0, 0.5, 1.2])]

    def run(general: bool):
        llm = LLM(str(path), skip_tokenizer_init=True, dtype="float32", block_size=4, max_num_seqs=4,
                  max_num_batched_tokens=24)
        runner = llm.llm_engine.core.worker.runner
        if general:
            def general_path(states, batch_rows, sampling_idx, sample_rows, hidden, out, staged=None, constraint=None):
                logits = runner.model.compute_logits(hidden[sample_rows])
                sel = [states[i] for i in sampling_idx.tolist()]
                meta = SamplingMetadata.build(
                    params=[s.sampling_params for s in sel], output_token_ids=[s.output_token_ids for s in sel],
                    prompt_token_ids=[s.prompt_token_ids for s in sel], seeds=[s.seed for s in sel],
                    vocab_size=logits.shape[-1], device=logits.device,
                    stop_token_ids_for_min_tokens=[s.stop_token_ids for s in sel])
                res = runner.sampler(logits, meta)
                cols = (res.logprob_token_ids.tolist(), res.logprobs.tolist(), res.ranks.tolist())
                for j, (i, s, tok) in enumerate(zip(sampling_idx.tolist(), sel, res.sampled_token_ids.tolist())):
                    s.token_ids.append(tok)
                    runner.input_batch.append_tokens(s.row, [tok])
                    out.sampled_token_ids[i] = [tok]
                    k = s.sampling_params.logprobs
                    out.logprobs[s.req_id] = tuple([col[j][: k + 1]] for col in cols)
                runner.sampling_state.invalidate(np.asarray(batch_rows, dtype=np.int64))

            runner._sample_one_each = general_path
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    assert run(general=False) == run(general=True)


def test_kv_decode_fast_path_changes_nothing_the_general_path_would_not():
    """Random decode/speculate steps on two managers, one with the O(1) decode shortcut off: the same
    blocks, hashes, cached entries and free queue after every step."""
    from keel.kv_cache.manager import KVCacheManager
    from keel.kv_cache.spec import FullAttentionSpec

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=4, dtype=torch.float32)
    for caching in (True, False):
        rng = random.Random(7)
        fast, slow = (KVCacheManager(spec, num_blocks=64, enable_caching=caching) for _ in range(2))
        slow.single_type_manager.keeps_all_blocks = False
        assert fast.single_type_manager.keeps_all_blocks
        reqs = {m: [SimpleNamespace(request_id=f"r{i}", all_token_ids=[1, 2, 3] * (i + 1),
                                    num_computed_tokens=0, block_hashes=[], cache_salt=None,
                                    num_tokens=3 * (i + 1)) for i in range(4)] for m in (fast, slow)}
        for _ in range(60):
            i = rng.randrange(4)
            lookahead = rng.choice([0, 0, 2])
            new_tokens = [rng.randrange(20)]
            results = []
            for m in (fast, slow):
                r = reqs[m][i]
                n = r.num_tokens - r.num_computed_tokens
                blocks = m.allocate_slots(r, n, num_lookahead_tokens=lookahead)
                results.append(None if blocks is None else blocks.get_block_ids())
                if blocks is not None:
                    r.num_computed_tokens += n
                    r.all_token_ids = r.all_token_ids + new_tokens
                    r.num_tokens = len(r.all_token_ids)
            assert results[0] == results[1]
            for a, b in zip(reqs[fast], reqs[slow]):
                assert fast.get_block_ids(a.request_id) == slow.get_block_ids(b.request_id)
                assert a.block_hashes == b.block_hashes
            assert set(fast.block_pool.cached_block_hash_to_block) == set(slow.block_pool.cached_block_hash_to_block)
            assert [b.block_id for b in fast.block_pool.free_block_queue.get_all_free_blocks()] == [
                b.block_id for b in slow.block_pool.free_block_queue.get_all_free_blocks()]


def test_sliding_window_manager_never_takes_the_decode_shortcut():
    from keel.kv_cache.manager import KVCacheManager
    from keel.kv_cache.spec import SlidingWindowSpec

    spec = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=4, dtype=torch.float32, sliding_window=8)
    assert not KVCacheManager(spec, num_blocks=8).single_type_manager.keeps_all_blocks
