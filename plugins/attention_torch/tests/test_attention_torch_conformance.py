"""The attention-backend conformance suite run against torch_paged, in each supported dtype."""

import torch
from keel.testing.attention import AttentionBackendConformance
from keel_attention_torch.backend import TorchPagedAttentionBackend


class TestTorchPagedFloat32(AttentionBackendConformance):
    backend = TorchPagedAttentionBackend
    dtype = torch.float32


class TestTorchPagedBFloat16(AttentionBackendConformance):
    backend = TorchPagedAttentionBackend
    dtype = torch.bfloat16


class TestTorchPagedFloat16(AttentionBackendConformance):
    backend = TorchPagedAttentionBackend
    dtype = torch.float16
