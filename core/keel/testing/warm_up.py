"""Whether the startup warm-up compiles every launch variant a kernel can take, for kernel plugins' tests.

A kernel whose compile-time constants follow a step's token count (tile configs per size, split counts) must
take each of its variants at one of the sizes `ModelRunner.warm_up` runs (`warm_up_prefill_sizes`), or the
variant compiles under load in the first big batch after start (DSV2-Lite's router split counts did:
round 1 at 0.91x its round 2 on an H100, fixed at d23276b). Pure Python: the variant function names the
constexprs, nothing is compiled.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from keel.worker.model_runner import warm_up_prefill_sizes


def unwarmed_token_counts(variant: Callable[[int], Hashable], max_num_tokens: int) -> dict[int, Hashable]:
    """{token count: its variant} for every step size 1 .. max_num_tokens whose variant no warm-up size takes
    (empty: the warm-up meets them all). `variant(tokens)` returns what the launch compiles per (its
    constexprs, hashable)."""
    warm = {variant(t) for t in warm_up_prefill_sizes(max_num_tokens)}
    return {t: v for t in range(1, max_num_tokens + 1) if (v := variant(t)) not in warm}


def assert_warm_up_meets(variant: Callable[[int], Hashable], max_num_tokens: int, what: str = "") -> None:
    """Fails naming the first step size whose variant the warm-up never compiles."""
    missing = unwarmed_token_counts(variant, max_num_tokens)
    if missing:
        first = min(missing)
        raise AssertionError(f"{what or 'a kernel'}: a {first}-token step's launch variant {missing[first]!r} is "
                             f"not taken at any warm-up size up to {max_num_tokens} tokens ({len(missing)} sizes)")
