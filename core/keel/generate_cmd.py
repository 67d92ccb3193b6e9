"""`keel generate MODEL-FLAGS --prompt TEXT [sampling flags]`: print completions.

Sampling flags left out take the model's defaults (`LLM.get_default_sampling_params`: its
generation_config.json), then SamplingParams' own, as vLLM's offline API does.
"""

from __future__ import annotations

import argparse
import json

# flag -> (type, help); every one defaults to "not given" (the model's default, then SamplingParams')
_SAMPLING_FLAGS = {
    "max_tokens": (int, "most tokens to generate (default: the model's max_new_tokens, else 64)"),
    "min_tokens": (int, "fewest tokens before EOS or a stop may end it (default: 0)"),
    "temperature": (float, "sampling temperature, 0 = greedy (default: the model's, else 1.0)"),
    "top_p": (float, "nucleus sampling mass (default: the model's, else 1.0)"),
    "top_k": (int, "sample among the k most likely tokens, 0 or -1 = all (default: the model's, else all)"),
    "min_p": (float, "drop tokens below min_p x the top probability (default: the model's, else 0.0)"),
    "n": (int, "completions per prompt (default: 1)"),
    "presence_penalty": (float, "penalize tokens that already appeared, once each (default: 0.0)"),
    "frequency_penalty": (float, "penalize tokens by how often they appeared (default: 0.0)"),
    "repetition_penalty": (float, "divide the logits of seen tokens, > 1 repeats less (default: the model's, "
                                       "else 1.0)"),
    "logprobs": (int, "print the log probability of each generated token and its N most likely "
                      "alternatives (default: not printed)"),
}
_DEFAULT_MAX_TOKENS = 64


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    from keel.cli import add_engine_cli_args

    add_engine_cli_args(parser, "generate")
    group = parser.add_argument_group("generation")
    group.add_argument("--prompt", action="append", required=True,
                       help="prompt text; repeat the flag for several prompts (default: required)")
    group.add_argument("--chat", action="store_true",
                       help="treat each prompt as a user chat message (default: off)")
    group.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                       help="chat template for --chat, a file or the Jinja text (default: the tokenizer's)")
    for name, (kind, text) in _SAMPLING_FLAGS.items():
        group.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=text)
    group.add_argument("--sampling-seed", type=int, default=None,
                       help="per-request sampling seed (default: drawn from the engine's --seed)")
    group.add_argument("--stop", action="append", default=None, help="stop string, repeatable (default: none)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS (default: off)")
    group.add_argument("--json", action="store_true", help="print outputs as JSON lines (default: off)")


def run_generate(ns: argparse.Namespace) -> int:
    from keel.chat_template import load_chat_template
    from keel.config import EngineArgs
    from keel.engine.llm import LLM, SERVER_ONLY_ARGS
    from keel.engine.sampling_params import SamplingParams
    from keel.models.generation_config import default_sampling_overrides

    given = {name: getattr(ns, name) for name in _SAMPLING_FLAGS if getattr(ns, name) is not None}
    given |= {"seed": ns.sampling_seed, "stop": ns.stop, "ignore_eos": ns.ignore_eos}
    SamplingParams(**given)  # a bad value fails here, before the model loads
    template = load_chat_template(ns.chat_template) if ns.chat_template is not None else None
    if template is not None and not ns.chat:
        raise _usage_error("--chat-template is used by --chat only; add --chat")
    args = vars(EngineArgs.from_cli_args(ns))
    server_only = ["--" + name.replace("_", "-") for name in SERVER_ONLY_ARGS if args.pop(name) is not None]
    if server_only:
        raise _usage_error(f"{', '.join(server_only)}: a keel serve setting; keel generate runs the engine here")
    llm = LLM(**args)
    defaults = default_sampling_overrides(llm.llm_engine.config.model.generation_config_fields)
    params = SamplingParams(**{"max_tokens": _DEFAULT_MAX_TOKENS, **defaults, **given})
    if ns.chat and template is None and getattr(llm.get_tokenizer(), "chat_template", None) is None:
        raise _usage_error("--chat: the model's tokenizer has no chat template; pass --chat-template FILE")
    if ns.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in ns.prompt], params, use_tqdm=False,
                        chat_template=template)
    else:
        outs = llm.generate(ns.prompt, params, use_tqdm=False)
    for prompt, out in zip(ns.prompt, outs):
        for c in out.outputs:
            if ns.json:
                print(json.dumps({"prompt": prompt, "index": c.index, "text": c.text, "token_ids": c.token_ids,
                                  "finish_reason": c.finish_reason, "cumulative_logprob": c.cumulative_logprob,
                                  **({"logprobs": _logprobs_json(c)} if c.logprobs is not None else {})}))
                continue
            print(f"{prompt}{c.text}")
            print(f"[finish_reason={c.finish_reason}, tokens={len(c.token_ids)}]")
            if c.logprobs is not None:
                _print_logprobs(c)
    return 0


def _usage_error(message: str) -> Exception:
    from keel.config import ConfigError

    return ConfigError(message)


def _print_logprobs(c) -> None:
    """One line per generated token: its logprob, then the alternatives by rank."""
    for token_id, alternatives in zip(c.token_ids, c.logprobs):
        chosen = alternatives[token_id]
        others = sorted(((t, lp) for t, lp in alternatives.items() if t != token_id),
                        key=lambda item: item[1].rank or 0)
        listed = "  ".join(f"{lp.decoded_token!r} {lp.logprob:.4f}" for _, lp in others)
        print(f"  {chosen.decoded_token!r:>12} {chosen.logprob:9.4f}  rank {chosen.rank}"
              + (f"  | {listed}" if listed else ""))


def _logprobs_json(c) -> list[dict]:
    return [{"token_id": t, "logprob": alts[t].logprob, "rank": alts[t].rank,
             "top": [{"token_id": a, "token": lp.decoded_token, "logprob": lp.logprob, "rank": lp.rank}
                     for a, lp in alts.items()]}
            for t, alts in zip(c.token_ids, c.logprobs)]
