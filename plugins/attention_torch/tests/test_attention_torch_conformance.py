"""The attention-backend conformance suite run against torch_paged, in each supported dtype."""

import pytest
import torch
from keel_attention_torch.backend import TorchPagedAttentionBackend

from keel.testing.attention import AttentionBackendConformance


class TestTorchPagedFloat32(AttentionBackendConformance):
    backend = TorchPagedAttentionBackend
    dtype = torch.float32


class TestTorchPagedBFloat16(AttentionBackendConformance):
    backend = TorchPagedAttentionBackend
    dtype = torch.bfloat16


class TestTorchPagedFloat16(AttentionBackendConformance):
    backend = TorchPagedAttentionBackend
    dtype = torch.float16


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
class TestTorchPagedCudaBFloat16(AttentionBackendConformance):
    backend = TorchPagedAttentionBackend
    device = "cuda"
    dtype = torch.bfloat16


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
class TestTorchPagedCudaFloat32(AttentionBackendConformance):
    backend = TorchPagedAttentionBackend
    device = "cuda"
    dtype = torch.float32
