"""Structured outputs end to end on a random-weight model (CPU): every output matches its constraint.

A random model has no idea of JSON; only the grammar bitmask keeps its tokens valid, so these tests
show the mask is applied to the right rows, advanced with the right tokens, and survives batch mixes,
chunked prefill, preemption, n > 1 and async scheduling. Constraints are bounded (enums, fixed-width
fields) so that every output must finish with "stop" and parse completely.
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch

from keel import LLM, SamplingParams
from keel.plugins.loader import load_plugins
from keel.structured_output.manager import select_backend
from keel.structured_output.params import StructuredOutputsParams

from keel.testing.tokenizer import make_tiny_model

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {
            "type": "object",
            "properties": {"unit": {"enum": ["cm", "in"]}, "ok": {"type": "boolean"}},
            "required": ["unit", "ok"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["color", "size", "tags"],
    "additionalProperties": False,
}
REGEX = r"(cat|dog)-[0-9]{2,4}"
CHOICES = ["yes", "no", 'maybe "so"', "日本"]
# A small EBNF: one-digit sums and products, at most two terms.
GRAMMAR = r"""
root ::= term (" + " term)?
term ::= digit | "(" digit " * " digit ")"
digit ::= [0-9]
"""
GRAMMAR_RE = r"(\d|\(\d \* \d\))( \+ (\d|\(\d \* \d\)))?"


def check_schema(value) -> None:
    assert set(value) == {"color", "size", "tags"}
    assert value["color"] in ("red", "green", "blue")
    assert set(value["size"]) == {"unit", "ok"} and value["size"]["unit"] in ("cm", "in")
    assert isinstance(value["size"]["ok"], bool)
    assert len(value["tags"]) <= 2 and all(t in ("a", "b") for t in value["tags"])


CONSTRAINTS = {
    "json": ({"json": SCHEMA, "disable_any_whitespace": True}, lambda t: check_schema(json.loads(t))),
    "regex": ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
    "choice": ({"choice": CHOICES}, lambda t: t in CHOICES or pytest.fail(t)),
    "grammar": ({"grammar": GRAMMAR}, lambda t: re.fullmatch(GRAMMAR_RE, t) or pytest.fail(t)),
}
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog. " * 3, "Numbers: 0 1 2", "日本語"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("so-llama"))


def make_llm(model_dir, **kw) -> LLM:
    kw = {"dtype": "float32", "max_model_len": 192, "block_size": 8, "seed": 0, **kw}
    return LLM(model=str(model_dir), **kw)


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir)


def mixed_batch():
    """Every constraint, greedy and seeded random, with unconstrained requests in between."""
    prompts, params, kinds = [], [], []
    for i, (kind, (spec, _)) in enumerate(CONSTRAINTS.items()):
        for j, temp in enumerate((0.0, 1.0)):
            prompts.append(PROMPTS[(i + j) % len(PROMPTS)])
            params.append(SamplingParams(max_tokens=120, temperature=temp, seed=10 * i + j, structured_outputs=spec))
            kinds.append(kind)
        prompts.append(PROMPTS[i])
        params.append(SamplingParams(max_tokens=8, temperature=0.0))
        kinds.append(None)
    return prompts, params, kinds


def check_outputs(outs, kinds) -> list[list[str]]:
    texts = []
    for out, kind in zip(outs, kinds):
        texts.append([c.text for c in out.outputs])
        if kind is None:
            continue
        for c in out.outputs:
            assert c.finish_reason == "stop", (kind, c.text)
            CONSTRAINTS[kind][1](c.text)
    return texts


def test_registered_backend():
    assert select_backend(load_plugins(["structured-output-xgrammar"]))().__name__ == "XGrammarBackend"


def test_constrained_outputs_are_valid_and_leave_other_rows_alone(llm):
    prompts, params, kinds = mixed_batch()
    texts = check_outputs(llm.generate(prompts, params, use_tqdm=False), kinds)
    # Unconstrained neighbours sample exactly what they sample alone.
    for i, kind in enumerate(kinds):
        if kind is None:
            alone = llm.generate([prompts[i]], params[i], use_tqdm=False)[0].outputs[0].text
            assert alone == texts[i][0]


def test_n_children_each_valid(llm):
    spec = CONSTRAINTS["json"][0]
    out = llm.generate(["Hello"], SamplingParams(n=3, max_tokens=120, temperature=1.0, seed=1,
                                                 structured_outputs=spec), use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        check_schema(json.loads(c.text))


@pytest.mark.parametrize("engine_kw", [
    {"async_scheduling": True},
    {"max_num_batched_tokens": 16, "enable_chunked_prefill": True},  # long prompts in chunks
    {"num_kv_blocks": 21, "max_model_len": 160, "max_num_seqs": 8},  # too few blocks for the batch: preemption
], ids=["async", "chunked", "preempt"])
def test_same_valid_outputs_across_scheduling_modes(model_dir, llm, engine_kw):
    prompts, params, kinds = mixed_batch()
    reference = check_outputs(llm.generate(prompts, params, use_tqdm=False), kinds)
    other = make_llm(model_dir, **engine_kw)
    try:
        assert check_outputs(other.generate(prompts, params, use_tqdm=False), kinds) == reference
        if "num_kv_blocks" in engine_kw:
            assert other.llm_engine.core.get_stats().num_preemptions_total > 0
    finally:
        other.llm_engine.shutdown()


def generate_checking_every_step(llm, prompts, params, kinds) -> list[list[str]]:
    """`check_outputs` of an async engine's run, which must have scheduled every request in every step
    from its first to its last: constrained ones too, their grammars advanced on the fill thread as the
    tokens before reached the host and their bitmask filled after that, while the step's forward runs."""
    core = llm.llm_engine.core
    assert core.async_scheduling and core.constrained_in_flight
    manager = core.scheduler.structured_output
    scheduled, schedule, advance = [], core.scheduler.schedule, manager._advance
    advanced: list[str] = []

    def spy():
        so = schedule()
        scheduled.append(set(so.num_scheduled_tokens))
        return so

    def spy_advance(*args):
        advanced.append(threading.current_thread().name)
        return advance(*args)

    core.scheduler.schedule, manager._advance = spy, spy_advance
    try:
        texts = check_outputs(llm.generate(prompts, params, use_tqdm=False), kinds)
    finally:
        core.scheduler.schedule, manager._advance = schedule, advance
    assert advanced and all(name.startswith("keel-grammar-fill") for name in advanced)
    for rid in set().union(*scheduled):
        steps = [i for i, ids in enumerate(scheduled) if rid in ids]
        assert steps == list(range(steps[0], steps[-1] + 1)), rid
    return texts


def test_async_scheduling_samples_constrained_requests_every_step(model_dir, llm):
    prompts, params, kinds = mixed_batch()
    reference = check_outputs(llm.generate(prompts, params, use_tqdm=False), kinds)
    other = make_llm(model_dir, async_scheduling=True)
    try:
        assert generate_checking_every_step(other, prompts, params, kinds) == reference
    finally:
        other.llm_engine.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_async_engine_with_the_fused_mask(tmp_path):
    """On the GPU with kernels-triton the runner's mask is the fused kernel, the bitmask is pinned, and
    async scheduling (on by default there) samples constrained requests every step, all valid. The model
    has head size 64: triton_flash serves 64 / 128 / 256 (the shared tiny model's 16 it refuses)."""
    model_dir = make_tiny_model(tmp_path / "llama-h64", head_dim=64)
    gpu = make_llm(model_dir, plugins=["platform-cuda", "attention-flash", "kernels-triton", "models-llama",
                                       "structured-output-xgrammar"], platform="cuda",
                   attention_backend="triton_flash", block_size=16, gpu_memory_utilization=0.3)
    try:
        core = gpu.llm_engine.core
        assert "apply_token_bitmask" in core.worker.runner.token_bitmask.bound_ops
        assert core.scheduler.structured_output.pin_memory
        generate_checking_every_step(gpu, *mixed_batch())
    finally:
        gpu.llm_engine.shutdown()


@pytest.mark.parametrize("spec, problem", [
    ({"json": {"type": "objectx"}}, "objectx"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "a(b"}, "parenthesis"),
    ({"grammar": "root ::= missing"}, "missing"),
    ({"choice": []}, "choice"),
    ({"json": {"type": "object"}, "regex": "a"}, "exactly one"),
    ({"json_object": True, "whitespace_pattern": " "}, "whitespace_pattern"),
])
def test_invalid_constraints_refused_before_queuing(llm, spec, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        llm.generate(["Hello"], SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_batch_fill_equals_one_by_one(llm):
    """The manager fills a step's rows in one threaded xgrammar call; rows equal each matcher's own fill,
    and a terminated matcher's row stays all-allowed."""
    from keel.structured_output.backend import BackendContext
    from keel.structured_output.manager import StructuredOutputManager
    from keel.structured_output.params import StructuredOutputsParams

    tok = llm.get_tokenizer()
    load = select_backend(load_plugins(["structured-output-xgrammar"]))
    vocab = len(tok)
    manager = StructuredOutputManager(load, lambda: BackendContext(tok, vocab, tok.eos_token_id), vocab)
    requests = [manager.add_request(StructuredOutputsParams.from_dict(c)) for c, _ in CONSTRAINTS.values()]
    while not all(r.is_ready() for r in requests):
        time.sleep(0.01)
    grammars = [r.grammar for r in requests]
    assert grammars[1].accept_tokens(tok.encode("cat-", add_special_tokens=False))
    assert grammars[2].accept_tokens(tok.encode("no", add_special_tokens=False) + [tok.eos_token_id])
    out = manager.grammar_bitmask(["a", "b", "c", "d"], grammars)
    for row, grammar in enumerate(grammars):
        one = torch.full_like(out.bitmask[:1], -1)
        if not grammar.is_terminated():
            grammar.fill_bitmask(one, 0)
        assert torch.equal(one[0], out.bitmask[row])
    manager.shutdown()


def test_terminated_flag_follows_the_matcher(llm):
    """The wrapper answers is_terminated from its own flag (no GIL-releasing library call per request per
    step); through single accepts, the batch accept, refused tokens, drafts validated and rollbacks past
    the stop token it equals xgrammar's own answer."""
    from keel.structured_output.backend import BackendContext

    tok = llm.get_tokenizer()
    load = select_backend(load_plugins(["structured-output-xgrammar"]))
    backend = load()(BackendContext(tok, len(tok), tok.eos_token_id))
    params = StructuredOutputsParams.from_dict(CONSTRAINTS["choice"][0])
    g = backend.grammar(backend.compile(params))
    h = backend.grammar(backend.compile(params))

    def same():
        for x in (g, h):
            assert x.is_terminated() == x.matcher.is_terminated()

    no = tok.encode("no", add_special_tokens=False)
    eos = tok.eos_token_id
    assert not g.accept_tokens([eos]) and not g.is_terminated()  # nothing chosen yet: refused
    same()
    assert g.validate_tokens(no + [eos]) == no + [eos] and not g.is_terminated()
    assert g.accept_tokens(no)
    same()
    assert backend.accept_tokens_batch([g, h], [eos, no[0]]) == [True, True]
    assert g.is_terminated()
    same()
    assert not g.accept_tokens(no)  # nothing after the end
    g.rollback(1)
    same()
    assert not g.is_terminated() and g.accept_tokens([eos]) and g.is_terminated()
    same()


def test_batch_accept_reports_each_refusal_and_end(llm):
    """The batch accept reads xgrammar's result in one call when every token was accepted, element by
    element otherwise: a refused token is reported (its grammar unchanged), an end token ends its grammar."""
    from keel.structured_output.backend import BackendContext

    tok = llm.get_tokenizer()
    backend = select_backend(load_plugins(["structured-output-xgrammar"]))()(
        BackendContext(tok, len(tok), tok.eos_token_id))
    compiled = backend.compile(StructuredOutputsParams.from_dict(CONSTRAINTS["choice"][0]))
    grammars = [backend.grammar(compiled) for _ in range(3)]
    no = tok.encode("no", add_special_tokens=False)
    eos = tok.eos_token_id
    assert grammars[2].accept_tokens(no)
    assert backend.accept_tokens_batch(grammars, [no[0], eos, eos]) == [True, False, True]
    assert [g.is_terminated() for g in grammars] == [False, False, True]
    assert grammars[1].accept_tokens(no) and not grammars[1].is_terminated()  # the refusal changed nothing
    assert backend.accept_tokens_batch(grammars[:2], [no[1], eos] if len(no) > 1 else [eos, eos]) == [True, True]


def test_draft_rows_batched_equal_row_by_row(llm):
    """With drafts the manager fills one verify position of every request per library call (batch fill,
    then batch accept); its rows equal the row-by-row path's -- drafts accepted, refused, ending the
    grammar, a grammar already ended -- and every grammar is back where it was."""
    from keel.structured_output.backend import BackendContext
    from keel.structured_output.manager import StructuredOutputManager

    tok = llm.get_tokenizer()
    load = select_backend(load_plugins(["structured-output-xgrammar"]))
    vocab = len(tok)
    manager = StructuredOutputManager(load, lambda: BackendContext(tok, vocab, tok.eos_token_id), vocab)
    specs = [CONSTRAINTS["choice"][0], CONSTRAINTS["regex"][0], CONSTRAINTS["choice"][0], CONSTRAINTS["json"][0]]
    requests = [manager.add_request(StructuredOutputsParams.from_dict(c)) for c in specs]
    while not all(r.is_ready() for r in requests):
        time.sleep(0.01)
    grammars = [r.grammar for r in requests]
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    eos = tok.eos_token_id
    assert grammars[2].accept_tokens(enc("no") + [eos])  # ended before the step
    drafts = [enc("no") + [eos, enc("x")[0]],  # accepted up to the end, then a row past it
              enc("cat-") + enc("zzz")[:1],  # a refused draft in the middle
              enc("yes")[:1],
              enc('{"')]
    batched = manager._fill_rows(sum(len(d) + 1 for d in drafts), grammars, drafts)
    ended = [g.is_terminated() for g in grammars]
    backend = manager._backend
    saved = backend.fill_bitmasks, backend.accept_tokens_batch
    backend.fill_bitmasks = backend.accept_tokens_batch = None  # the row-by-row path
    try:
        one_by_one = manager._fill_rows(batched.shape[0], grammars, drafts)
    finally:
        backend.fill_bitmasks, backend.accept_tokens_batch = saved
    assert torch.equal(batched, one_by_one)
    assert [g.is_terminated() for g in grammars] == ended == [False, False, True, False]
    assert (batched[len(drafts[0])] == -1).all()  # the row after the end token allows everything
    manager.shutdown()


@pytest.mark.parametrize("cpus,cores,threads", [(2, 2, 1), (16, 8, 6), (16, 16, 8), (64, 32, 8), (8, None, 4)])
def test_fill_threads_leave_cores_to_the_engine_loop(monkeypatch, cpus, cores, threads):
    from keel_structured_output_xgrammar import backend

    monkeypatch.setattr(backend.os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    monkeypatch.setattr(backend, "physical_cores", lambda: cores)
    assert backend.fill_threads() == threads
