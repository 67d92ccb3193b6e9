"""A small byte-level BPE tokenizer trained locally, for tests and the demo checkpoint.

No tokenizer can be downloaded in tests, so `build_tokenizer` trains one with the `tokenizers` library
on the corpus embedded below and writes it in the Hugging Face layout (`tokenizer.json`,
`tokenizer_config.json` with a ChatML chat template, `special_tokens_map.json`) so that
`transformers.AutoTokenizer.from_pretrained(path)` loads it. The corpus mixes plain English with
accented, CJK and emoji lines: frequent multi-byte characters get merged tokens, rare ones stay split
over several byte tokens -- exactly what incremental detokenization must survive.

Training is deterministic, so the same `vocab_size` always gives byte-identical files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order fixes the ids: pad 0, bos 1, eos 2 (Llama's bos/eos ids), then the chat markers.
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START, IM_END]

# ChatML framing; the bos token opens the rendered text because chat prompts are tokenized without
# adding special tokens (as HF's apply_chat_template and vLLM's chat endpoint do). `content` may be a
# string or a list of OpenAI-style parts, of which the text parts are kept.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun while the fox runs away.
Once upon a time there was a small village at the edge of a great forest. The people of the village
were farmers and bakers, and every morning the smell of fresh bread filled the narrow streets.
A language model reads a sequence of tokens and predicts the next token. It does this again and again,
one token at a time, until it reaches a stop token or the maximum number of tokens.
An inference engine keeps the keys and values of every layer in a paged cache. Each page is a block of
tokens, and a block table maps the logical blocks of a sequence to physical blocks in memory.
The scheduler decides which requests run in each step. It spends a budget of tokens across the running
requests first, then the waiting ones, so that long prompts are split into chunks.
Hello, world! How are you today? I am fine, thank you. What is your name? My name is Keel.
What is the capital of France? The capital of France is Paris. What is the capital of Japan? Tokyo.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 256 1024 2048 3.14159 2.71828 42.
Code: def add(a, b): return a + b. for i in range(10): print(i). x = [1, 2, 3]; y = {"a": 1}.
The river flows to the sea, and the sea returns the rain to the mountains. Nothing is ever lost.
She said that she would come tomorrow, but he did not believe her. They waited for a long time.
In the morning the birds sing; in the evening the stars appear one by one above the quiet hills.
Learning is a journey, not a destination. Read widely, write often, and ask good questions.
The system prompt tells the assistant how to behave. The user asks a question and the assistant answers.
Please summarize the following text in one sentence. Translate this sentence into French.
Café, crème brûlée, naïve, façade, résumé, déjà vu, über, Ångström, señor, piñata, São Paulo.
Le café est très bon. L'élève étudie à l'école. Où est la bibliothèque? Ça va très bien, merci.
Die Straße ist schön. Größe, Übung, Mädchen, Frühstück. Ich möchte einen Kaffee, bitte.
El niño come una manzana. ¿Dónde está la estación? ¡Qué día tan bonito! Mañana será mejor.
Русский язык: привет, как дела? Спасибо, хорошо. Ελληνικά: γεια σου, καλημέρα.
日本語のテキスト：こんにちは、世界。今日はいい天気ですね。東京は日本の首都です。
中文文本：你好，世界。我们今天学习语言模型。北京是中国的首都。
한국어: 안녕하세요, 세계. 감사합니다.
Emoji: 😀 🎉 🚀 🌍 ❤️ 👍 🐍 🤖 ✨ 🔥 — “quotes” ‘single’ … • © ® ™ € £ ¥ ± × ÷ ≤ ≥ ∞ → ←.
"""

# Repeating the English part gives the trainer enough pair counts to fill the vocabulary with useful
# word pieces; the non-ASCII lines appear once so that their rarer characters stay byte-split.
_ENGLISH_REPEATS = 4


def _training_lines() -> list[str]:
    lines = CORPUS.splitlines()
    english = [line for line in lines if line.isascii()]
    return lines + english * (_ENGLISH_REPEATS - 1)


def _train(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_lines(), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    # Like Llama: plain prompts get a leading bos; the byte-level processor keeps offsets right.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tok


def _tokenizer_config(tok) -> dict:
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }


def build_tokenizer(path: str | os.PathLike[str], vocab_size: int = 512):
    """Train the demo tokenizer and save it under `path`; return it loaded as a fast HF tokenizer.

    `vocab_size` counts the special tokens and must leave room above the 256 byte tokens. The files
    written are tokenizer.json, tokenizer_config.json (with `chat_template`) and
    special_tokens_map.json; existing files of those names are overwritten.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE: it needs at least "
            f"{256 + len(SPECIAL_TOKENS)} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train(vocab_size)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    _write_json(out / "tokenizer_config.json", _tokenizer_config(tok))
    _write_json(
        out / "special_tokens_map.json",
        {
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "additional_special_tokens": [IM_START, IM_END],
        },
    )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(out))


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every text `encode` gets (tests of what a code path
    tokenizes); everything else is delegated."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.encoded: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def encode(self, text: str, **kwargs: Any) -> Any:
        self.encoded.append(len(text))
        return self.tokenizer.encode(text, **kwargs)


def whitespace_ban(tokenizer) -> dict[str, float]:
    """An OpenAI `logit_bias` against every whitespace-only token. JSON modes allow free whitespace between
    tokens, which a random-weight model would otherwise pick until max_tokens."""
    return {str(i): -100.0 for i in range(len(tokenizer)) if tokenizer.decode([i]).isspace()}


def make_tiny_model(path: Any, vocab_size: int = 512, **config: Any) -> Any:
    """A tiny random Llama plus the local test tokenizer (with a ChatML template) in `path`."""
    from keel.testing.checkpoints import make_checkpoint

    make_checkpoint("llama", path, vocab_size=vocab_size, **config)
    build_tokenizer(path, vocab_size=vocab_size)
    return path
