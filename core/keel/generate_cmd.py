"""`keel generate --model PATH --prompt TEXT [sampling flags]`: print completions."""

from __future__ import annotations

import argparse
import json


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    from keel.cli import add_engine_cli_args

    add_engine_cli_args(parser, "generate")
    parser.add_argument("--prompt", action="append", required=True,
                        help="prompt text (repeat the flag for several prompts)")
    parser.add_argument("--chat", action="store_true", help="treat each prompt as a user chat message")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--min-tokens", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--logprobs", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print outputs as JSON lines")


def run_generate(ns: argparse.Namespace) -> int:
    from keel.config import EngineArgs
    from keel.engine.llm import LLM
    from keel.engine.sampling_params import SamplingParams

    params = SamplingParams(
        n=ns.n, max_tokens=ns.max_tokens, min_tokens=ns.min_tokens, temperature=ns.temperature,
        top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p, seed=ns.sampling_seed,
        presence_penalty=ns.presence_penalty, frequency_penalty=ns.frequency_penalty,
        repetition_penalty=ns.repetition_penalty, stop=ns.stop, ignore_eos=ns.ignore_eos,
        logprobs=ns.logprobs,
    )
    args = EngineArgs.from_cli_args(ns)
    llm = LLM(**vars(args))
    if ns.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in ns.prompt], params, use_tqdm=False)
    else:
        outs = llm.generate(ns.prompt, params, use_tqdm=False)
    for prompt, out in zip(ns.prompt, outs):
        for c in out.outputs:
            if ns.json:
                print(json.dumps({"prompt": prompt, "index": c.index, "text": c.text, "token_ids": c.token_ids,
                                  "finish_reason": c.finish_reason, "cumulative_logprob": c.cumulative_logprob}))
            else:
                print(f"{prompt}{c.text}")
                print(f"[finish_reason={c.finish_reason}, tokens={len(c.token_ids)}]")
    return 0
