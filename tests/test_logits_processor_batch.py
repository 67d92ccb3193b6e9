"""The `logits_processor` kind's batch updates: whatever the scheduler does to the rows that sample
(requests join, leave, reorder, come back after preemption), a processor that applies each `BatchUpdate`
in vLLM's order (removed, added, moved) holds every request at its logits row, within the batch."""

from __future__ import annotations

import random

import pytest

from keel.engine.sampling_params import SamplingParams
from keel.logits_processor import BatchUpdate, LogitsProcessor, process_dict_updates, resolve_logits_processors
from keel.worker.logits_batch import LogitsProcessorBatch
from keel.worker.request_state import CachedRequestState


def state(rid: str, prompt=(1, 2, 3)) -> CachedRequestState:
    return CachedRequestState(req_id=rid, token_ids=list(prompt), num_prompt_tokens=len(prompt),
                              sampling_params=SamplingParams(), seed=0, block_ids=[], num_computed_tokens=0,
                              stop_token_ids=frozenset())


class Recorder(LogitsProcessor):
    """Keeps {index: (request's prompt list object, output view)} as a processor would."""

    def __init__(self, config=None, device=None, is_pin_memory=False) -> None:
        self.rows: dict[int, tuple] = {}
        self.updates: list[BatchUpdate | None] = []

    def apply(self, logits):
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update):
        self.updates.append(batch_update)
        process_dict_updates(self.rows, batch_update, lambda params, prompt, output: (prompt, output))


def test_random_layouts_keep_every_request_at_its_row():
    rng = random.Random(0)
    rec = Recorder()
    batch = LogitsProcessorBatch([rec])
    live: dict[str, CachedRequestState] = {}
    next_id = 0
    for _ in range(400):
        # Some leave, some join, some are resumed as new states (preemption), the order shuffles.
        for rid in list(live):
            if rng.random() < 0.2:
                del live[rid]
            elif rng.random() < 0.05:
                live[rid] = state(rid)
        for _ in range(rng.randrange(4)):
            live[f"r{next_id}"] = state(f"r{next_id}")
            next_id += 1
        sampling = [s for s in live.values() if rng.random() < 0.85]  # prefill chunks do not sample
        rng.shuffle(sampling)
        sampling = sampling[:8]  # max_num_seqs
        batch.step(sampling)
        for s in sampling:
            s.token_ids.append(rng.randrange(100))
        update = rec.updates[-1]
        if update is not None:
            assert update.batch_size == len(sampling)
            assert all(0 <= i < 8 for i, *_ in update.added)
            assert all(0 <= i < 8 and 0 <= j < 8 for i, j, _ in update.moved)
        assert sorted(rec.rows) == list(range(len(sampling)))
        for i, s in enumerate(sampling):
            _, output = rec.rows[i]
            assert list(output) == s.token_ids[s.num_prompt_tokens:]  # the live view of this very request


def test_unchanged_batch_is_none_and_output_view_is_live():
    rec = Recorder()
    batch = LogitsProcessorBatch([rec])
    a, b = state("a"), state("b", prompt=(7,))
    batch.step([a, b])
    first = rec.updates[-1]
    assert [i for i, *_ in first.added] == [0, 1] and not first.removed and not first.moved
    b.token_ids += [8, 9]
    batch.step([a, b])
    assert rec.updates[-1] is None
    prompt, output = rec.rows[1]
    assert list(prompt) == [7] and list(output) == [8, 9] and output[-1] == 9 and output[:1] == [8]
    batch.step([b, a])
    swap = rec.updates[-1]
    assert not swap.added and not swap.removed and len(swap.moved) == 1


def test_resolution_by_key_qualified_name_and_class():
    class Registry(dict):
        def get(self, key):
            return self[key]

    class Plugins:
        def registry(self, kind):
            assert kind == "logits_processor"
            return Registry(rec=Recorder)

    plugins = Plugins()
    qualified = f"{__name__}:Recorder"
    assert resolve_logits_processors(["rec", qualified, Recorder], plugins) == [Recorder] * 3
    with pytest.raises(ValueError, match="'nope'.*known: \\['rec'\\]"):
        resolve_logits_processors(["nope"], plugins)
    with pytest.raises(ValueError, match="cannot import 'no.such:Thing'"):
        resolve_logits_processors(["no.such:Thing"], plugins)
    with pytest.raises(ValueError, match="not a keel.logits_processor.LogitsProcessor"):
        resolve_logits_processors([f"{__name__}:state"], plugins)
