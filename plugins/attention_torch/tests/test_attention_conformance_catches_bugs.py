"""The conformance suite must fail on broken backends: torch_paged with one deliberate bug each."""

import dataclasses

import pytest
import torch
from keel_attention_torch.backend import TorchPagedAttentionBackend
from keel_attention_torch.impl import TorchPagedAttentionImpl
from keel_attention_torch.metadata import TorchPagedMetadataBuilder

from keel.testing.attention import AttentionBackendConformance


class _IgnoresWindow(TorchPagedAttentionBackend):
    @classmethod
    def get_impl(cls, layer):
        impl = TorchPagedAttentionImpl(layer)
        impl.sliding_window = None
        return impl


class _WritesPaddingToNullBlock(TorchPagedAttentionBackend):
    class Builder(TorchPagedMetadataBuilder):
        def build(self, common):
            md = super().build(common)
            md.write_rows, md.write_slots = None, common.slot_mapping.clamp(min=0)
            return md

    @classmethod
    def get_metadata_builder(cls, device):
        return cls.Builder(device)


class _NeverMasksDecode(TorchPagedAttentionBackend):
    class Builder(TorchPagedMetadataBuilder):
        def build(self, common):
            md = super().build(common)
            plan = md.plan(None)
            if plan.decode is not None:
                md._plans[None] = dataclasses.replace(plan, decode=dataclasses.replace(plan.decode, mask=None))
            return md

    @classmethod
    def get_metadata_builder(cls, device):
        return cls.Builder(device)


@pytest.mark.parametrize(
    ("backend", "test_name"),
    [
        (_IgnoresWindow, "test_sliding_window"),
        (_WritesPaddingToNullBlock, "test_padding_tokens"),
        (_NeverMasksDecode, "test_pure_decode"),
        (_NeverMasksDecode, "test_mixed_prefill_decode"),
    ],
)
def test_suite_fails_broken_backend(backend, test_name):
    suite = type("Suite", (AttentionBackendConformance,), {"backend": backend, "dtype": torch.float32})()
    with pytest.raises(AssertionError):
        getattr(suite, test_name)()
