"""RequestOutput / CompletionOutput / Logprob: vLLM-shaped fields, finished(), repr and add()."""

from keel.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def _completion(index: int, text: str, ids: list[int], finish: str | None = None) -> CompletionOutput:
    lps = [{i: Logprob(-0.5, rank=1, decoded_token=str(i))} for i in ids]
    return CompletionOutput(index, text, ids, -0.5 * len(ids), lps, finish_reason=finish)


def test_logprob_defaults() -> None:
    lp = Logprob(-1.25)
    assert (lp.logprob, lp.rank, lp.decoded_token) == (-1.25, None, None)
    assert Logprob(-1.0, 3, "a") == Logprob(logprob=-1.0, rank=3, decoded_token="a")


def test_completion_output_finished_and_repr() -> None:
    c = CompletionOutput(index=0, text="hi", token_ids=[5, 6], cumulative_logprob=None, logprobs=None)
    assert not c.finished()
    assert c.stop_reason is None
    c.finish_reason = "stop"
    c.stop_reason = "\n"
    assert c.finished()
    assert repr(c) == (
        "CompletionOutput(index=0, text='hi', token_ids=[5, 6], cumulative_logprob=None, "
        "logprobs=None, finish_reason=stop, stop_reason=\n)"
    )


def test_request_output_fields_and_repr() -> None:
    out = RequestOutput(
        request_id="r1",
        prompt="Hello",
        prompt_token_ids=[1, 2],
        prompt_logprobs=[None, {2: Logprob(-0.1, 1, "x")}],
        outputs=[_completion(0, "a", [3])],
        finished=False,
        metrics=RequestMetrics(arrival_time=1.0),
    )
    assert out.prompt_logprobs[0] is None
    text = repr(out)
    assert text.startswith("RequestOutput(request_id=r1, prompt='Hello', prompt_token_ids=[1, 2]")
    assert "outputs=[CompletionOutput(index=0, text='a'" in text
    assert "finished=False" in text


def test_add_aggregates_deltas_per_index() -> None:
    out = RequestOutput("r", None, [1], None, [_completion(0, "ab", [3, 4])], finished=False)
    nxt = RequestOutput(
        "r", None, [1], None, [_completion(0, "c", [5], "length"), _completion(1, "z", [9])], finished=True
    )
    out.add(nxt, aggregate=True)
    first, second = out.outputs
    assert (first.text, first.token_ids, first.finish_reason) == ("abc", [3, 4, 5], "length")
    assert len(first.logprobs) == 3 and first.cumulative_logprob == -0.5
    assert second.index == 1 and second.text == "z"
    assert out.finished


def test_add_replaces_cumulative_outputs() -> None:
    out = RequestOutput("r", "p", [1], None, [_completion(0, "ab", [3, 4])], finished=False)
    newer = _completion(0, "abc", [3, 4, 5], "stop")
    out.add(RequestOutput("r", "p", [1], None, [newer], finished=True), aggregate=False)
    assert out.outputs == [newer]
    assert out.finished


def test_lazy_top_level_names() -> None:
    import keel

    assert keel.RequestOutput is RequestOutput
    assert keel.CompletionOutput is CompletionOutput
    assert keel.Logprob is Logprob
