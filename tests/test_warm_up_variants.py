"""keel.testing.warm_up: the startup warm-up's prefill sizes, and the check kernel plugins run that every launch
variant a step can take is taken at one of them."""

from __future__ import annotations

import pytest

from keel.testing.warm_up import assert_warm_up_meets, unwarmed_token_counts
from keel.worker.model_runner import warm_up_prefill_sizes


def test_the_prefill_sizes_are_powers_of_two_and_odd_counts_past_512():
    assert warm_up_prefill_sizes(8192)[:14] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1019, 1023, 1024, 2043]
    assert warm_up_prefill_sizes(8192)[-1] == 8192 and warm_up_prefill_sizes(6000)[-1] == 6000  # the limit itself


def test_a_variant_between_the_warm_up_sizes_is_named():
    def by_power_of_two(t):  # what the router's split count follows since d23276b
        return 1 << (t - 1).bit_length()

    assert unwarmed_token_counts(by_power_of_two, 8192) == {}
    assert_warm_up_meets(by_power_of_two, 8192)

    def window(t):  # a variant only 301..400-token steps take: no warm-up size is there
        return 300 < t <= 400

    assert sorted(unwarmed_token_counts(window, 8192)) == list(range(301, 401))
    with pytest.raises(AssertionError, match="a 301-token step's launch variant True"):
        assert_warm_up_meets(window, 8192, "window")
