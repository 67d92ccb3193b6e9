"""The attention-backend conformance suite run against triton_flash: interpreted on the CPU, compiled
on CUDA."""

import pytest
import torch
from keel_attention_flash.backend import TritonFlashAttentionBackend

from keel.testing.attention import AttentionBackendConformance

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted runs are for machines without a GPU")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@cpu_only
class TestTritonFlashInterpretedFloat32(AttentionBackendConformance):
    backend = TritonFlashAttentionBackend
    dtype = torch.float32


@cpu_only
class TestTritonFlashInterpretedBFloat16(AttentionBackendConformance):
    backend = TritonFlashAttentionBackend
    dtype = torch.bfloat16


@pytest.mark.cuda
@needs_cuda
class TestTritonFlashCudaFloat32(AttentionBackendConformance):
    backend = TritonFlashAttentionBackend
    device = "cuda"
    dtype = torch.float32


@pytest.mark.cuda
@needs_cuda
class TestTritonFlashCudaBFloat16(AttentionBackendConformance):
    backend = TritonFlashAttentionBackend
    device = "cuda"
    dtype = torch.bfloat16


@pytest.mark.cuda
@needs_cuda
class TestTritonFlashCudaFloat16(AttentionBackendConformance):
    backend = TritonFlashAttentionBackend
    device = "cuda"
    dtype = torch.float16
