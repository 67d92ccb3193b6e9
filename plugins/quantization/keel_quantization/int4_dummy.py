"""Dummy values (`load_format="dummy"`) for the 4-bit layouts: valid packed words, group ids, small scales.

The model loader fills a parameter carrying a `dummy_init(tensor, generator)` attribute with it, so a
GPTQ / AWQ model can be benchmarked without a checkpoint: random nibbles, `g_idx` as the checkpoint's
own (global) group of each input, and scales that give the dequantized weight ~N(0, 1/fan_in) magnitude
((q - zero) has a standard deviation of about 6.5 for uniform nibbles).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from keel.models.weights import set_weight_attrs

Init = Callable[[torch.Tensor, torch.Generator], None]


def random_words(t: torch.Tensor, gen: torch.Generator) -> None:
    t.copy_(torch.randint(-(2**31), 2**31 - 1, t.shape, generator=gen, device=t.device, dtype=torch.int64))


def group_ids(group: int, first_input: int) -> Init:
    """g_idx over the last dimension: inputs first_input, first_input + 1, ... of the checkpoint."""
    def init(t: torch.Tensor, gen: torch.Generator) -> None:
        k = t.shape[-1]
        t.copy_(((torch.arange(k, device=t.device) + first_input) // group).to(t.dtype).expand_as(t))
    return init


def scales(fan_in: int) -> Init:
    def init(t: torch.Tensor, gen: torch.Generator) -> None:
        u = torch.rand(t.shape, generator=gen, device=t.device)
        t.copy_((0.75 + 0.5 * u) / (6.5 * math.sqrt(fan_in)))
    return init


def mark(module: torch.nn.Module, **inits: Init) -> None:
    """Attach dummy initializers to `module`'s parameters by name."""
    for name, init in inits.items():
        set_weight_attrs(getattr(module, name), dummy_init=init)
