"""IncrementalDetokenizer: exact final text, streaming deltas, multi-byte characters, stop strings."""

import random

import pytest
from transformers import AutoTokenizer

from keel.engine.detokenizer import IncrementalDetokenizer, decode_token, decode_tokens
from keel.engine.sampling_params import SamplingParams
from keel.testing.tokenizer import build_tokenizer

REPLACEMENT = "\ufffd"
MULTIBYTE = "Café 日本語 😀 🦀 こんにちは, naïve “quotes” and 🐍🤖✨ end"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> tuple[list[str], str | None]:
    """Feed ids `chunk` at a time like engine steps; return the deltas (last one at finish)."""
    deltas: list[str] = []
    stop = None
    for start in range(0, len(ids), chunk):
        stop = detok.update(ids[start : start + chunk])
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            return deltas, stop
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas, stop


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("chunk", [1, 3])
def test_random_ids_match_decode(tokenizer, skip_special_tokens, chunk) -> None:
    rng = random.Random(chunk + 10 * skip_special_tokens)
    for _ in range(20):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 80))]
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip_special_tokens)
        deltas, _ = stream(detok, ids, chunk)
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert detok.output_text == expected
        assert "".join(deltas) == expected
        assert detok.output_token_ids == ids


def test_multibyte_text_never_streams_replacement_char(tokenizer) -> None:
    ids = encode(tokenizer, MULTIBYTE)
    # The rare characters really are split over byte tokens, so this exercises the hold-back.
    assert sum(REPLACEMENT in tokenizer.decode([i]) for i in ids) >= 4
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Say: "))
    deltas, _ = stream(detok, ids)
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == detok.output_text == MULTIBYTE


def test_stream_ending_mid_character_is_flushed_at_finish(tokenizer) -> None:
    ids = encode(tokenizer, "ok 🦀")[:-1]  # cut the emoji's last byte token
    detok = IncrementalDetokenizer(tokenizer, [1])
    for i in ids:
        detok.update([i])
        assert REPLACEMENT not in detok.get_next_output_text(finished=False, delta=True)
    assert detok.get_next_output_text(finished=True, delta=False) == tokenizer.decode(ids)
    assert detok.output_text.endswith(REPLACEMENT)


def test_work_per_token_is_bounded(tokenizer) -> None:
    # Each step decodes a short window, never the whole output: O(new tokens), not O(length).
    windows: list[int] = []
    real_decode = tokenizer.decode

    class Counting:
        def __len__(self) -> int:
            return len(tokenizer)

        def decode(self, ids, **kwargs):
            windows.append(len(ids))
            return real_decode(ids, **kwargs)

    ids = encode(tokenizer, (MULTIBYTE + " The quick brown fox. ") * 40)
    detok = IncrementalDetokenizer(Counting(), [1])
    deltas, _ = stream(detok, ids, chunk=2)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert len(windows) <= 2 * len(ids) + 2
    assert max(windows) <= 16


def test_prompt_context_and_out_of_vocab_ids(tokenizer) -> None:
    prompt = tokenizer("The capital of France is").input_ids
    out = encode(tokenizer, " Paris. Tokyo!")
    detok = IncrementalDetokenizer(tokenizer, prompt + [10_000])
    deltas, _ = stream(detok, out[:2] + [len(tokenizer) + 7] + out[2:])
    assert "".join(deltas) == " Paris. Tokyo!"
    assert len(detok.token_ids) == len(out) + 1


def test_skip_special_tokens(tokenizer) -> None:
    ids = [tokenizer.bos_token_id, *encode(tokenizer, "Hi there"), tokenizer.eos_token_id]
    skip = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    keep = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(stream(skip, ids)[0]) == "Hi there"
    assert "".join(stream(keep, ids)[0]) == "<s>Hi there</s>"


def test_stop_token_is_not_decoded(tokenizer) -> None:
    ids = encode(tokenizer, "Hi there")
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert detok.update([*ids, tokenizer.eos_token_id], stop_terminated=True) is None
    assert detok.get_next_output_text(finished=True, delta=False) == "Hi there"
    assert detok.token_ids[-1] == tokenizer.eos_token_id


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(tokenizer, include) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids = encode(tokenizer, text)
    stop = "fox jumps"
    assert not any(stop in tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer, [1], stop=[stop], include_stop_str_in_output=include)
    deltas, matched = stream(detok, ids)
    assert matched == stop == detok.stop_string
    expected = "The quick brown fox jumps" if include else "The quick brown "
    assert detok.output_text == expected
    assert "".join(deltas) == expected
    assert detok.update(encode(tokenizer, " more")) is None  # ignored after the stop
    assert detok.output_text == expected


@pytest.mark.parametrize("include", [False, True])
def test_text_after_stop_in_same_update_is_dropped(tokenizer, include) -> None:
    ids = encode(tokenizer, "one, two; three, four")
    detok = IncrementalDetokenizer(tokenizer, [], stop=[";"], include_stop_str_in_output=include)
    assert detok.update(ids) == ";"
    assert detok.get_next_output_text(finished=True, delta=True) == ("one, two;" if include else "one, two")


def test_partial_stop_string_is_held_back_then_released(tokenizer) -> None:
    text = "Hello world, the end of the world."
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["the world!"])
    streamed = ""
    for i in ids:
        assert detok.update([i]) is None
        streamed += detok.get_next_output_text(finished=False, delta=True)
        # The last len(stop) - 1 characters are never sent while the request runs.
        assert streamed == detok.output_text[: max(len(detok.output_text) - 9, 0)]
    assert detok.get_next_output_text(finished=False, delta=False) == text[:-9]
    streamed += detok.get_next_output_text(finished=True, delta=True)
    assert streamed == text
    assert detok.stop_string is None


def test_streaming_never_emits_a_stop_string_prefix(tokenizer) -> None:
    text = "abc STOP! def STOPPED"
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["STOPPED", "STOP!"])
    deltas, matched = stream(detok, ids)
    assert matched == "STOP!"
    assert "".join(deltas) == "abc "


def test_earliest_stop_string_wins(tokenizer) -> None:
    ids = encode(tokenizer, "red green blue")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["blue", "green", "een b"])
    assert detok.update(ids) == "green"
    assert detok.output_text == "red "


def test_multibyte_stop_string(tokenizer) -> None:
    ids = encode(tokenizer, "crab 🦀 here")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["🦀"], include_stop_str_in_output=True)
    deltas, matched = stream(detok, ids)
    assert matched == "🦀"
    assert "".join(deltas) == detok.output_text == "crab 🦀"


def test_min_tokens_defers_stop_strings(tokenizer) -> None:
    ids = encode(tokenizer, "a. b. c.")
    assert tokenizer.convert_ids_to_tokens(ids) == ["a", ".", "Ġb", ".", "Ġc", "."]
    params = SamplingParams(stop=["."], min_tokens=3)
    detok = IncrementalDetokenizer.from_sampling_params(tokenizer, [], params)
    assert (detok.stop, detok.min_tokens, detok.stop_buffer_length) == (["."], 3, 0)
    _, matched = stream(detok, ids)
    # The "." of tokens 2 (within min_tokens) is ignored; the one of token 4 stops.
    assert matched == "."
    assert detok.output_text == "a. b"


def test_decode_token(tokenizer) -> None:
    ids = encode(tokenizer, "Hello 🦀")
    assert decode_tokens(tokenizer, ids) == [tokenizer.decode([i]) for i in ids]
    assert REPLACEMENT in decode_token(tokenizer, ids[-1])
    assert decode_token(tokenizer, len(tokenizer) + 3) == ""
    assert decode_token(tokenizer, ids[0]) is decode_token(tokenizer, ids[0])  # cached


def test_rejects_missing_tokenizer() -> None:
    with pytest.raises(TypeError, match="needs a tokenizer"):
        IncrementalDetokenizer(None, [])


def test_check_stop_strings_searches_only_new_text() -> None:
    from keel.engine.stop_checker import check_stop_strings

    # "ab" lies entirely in old text (new text is the last 2 chars): not searched again.
    assert check_stop_strings("xxabyy", 2, ["ab"], include_in_output=False) is None
    # A stop string straddling old and new text is found.
    assert check_stop_strings("xxabyy", 5, ["ab"], include_in_output=False) == ("ab", 2)
    assert check_stop_strings("xxaby", 3, ["by"], include_in_output=True) == ("by", -1)
    assert check_stop_strings("xxabyy", 4, ["ab"], include_in_output=True) == ("ab", 4)
    assert check_stop_strings("xxabyy", 0, ["ab"], include_in_output=False) is None


def test_context_dependent_decoder_keeps_leading_space() -> None:
    # A sentencepiece-style decoder strips the leading space of whatever it decodes first; decoding
    # with prompt context keeps the space that separates the output from the prompt.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = ["Hello world again and again", "the world is big"]
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>"], show_progress=False)
    )
    sp = PreTrainedTokenizerFast(tokenizer_object=tok)
    prompt = sp("Hello").input_ids
    out = sp(" world again", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(sp, prompt)
    deltas, _ = stream(detok, out)
    assert "".join(deltas) == " world again"
    assert sp.decode(prompt) + detok.output_text == sp.decode(prompt + out)
