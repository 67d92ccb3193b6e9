"""The CUDA platform plugin: conformance (device checks skip without a GPU), selection, profile, NCCL."""

from __future__ import annotations

import importlib

import pytest
import torch
from keel_platform_cuda.communicator import CommunicatorError, NcclCommunicator
from keel_platform_cuda.platform import CAPTURE_SIZES, CudaPlatform

from keel.platform import PlatformError, select_platform
from keel.plugins.loader import load_plugins
from keel.profile import load_profile
from keel.testing.platform import PlatformConformance

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


class TestCudaPlatformConformance(PlatformConformance):
    platform_cls = CudaPlatform
    entry_point = "platform-cuda"


def test_identity_and_preference():
    p = CudaPlatform()
    assert (p.name, p.device_type, p.dist_backend) == ("cuda", "cuda", "nccl")
    assert p.attention_backend_preference()[0] == "triton_flash"
    assert p.priority > 0 and p.supports_graph_capture


def test_graph_capture_spec_names_an_importable_capturer():
    spec = CudaPlatform().graph_capture()
    assert spec.supported and spec.batch_sizes == CAPTURE_SIZES
    assert list(spec.batch_sizes) == sorted(set(spec.batch_sizes)) and spec.batch_sizes[0] == 1
    module, _, attr = spec.capturer.partition(":")
    assert callable(getattr(importlib.import_module(module), attr))


def test_communicator_spec_is_nccl():
    comm = CudaPlatform().communicator()
    assert comm.dist_backend == "nccl"
    module, _, attr = comm.device_communicator.partition(":")
    assert getattr(importlib.import_module(module), attr) is NcclCommunicator


def test_communicator_requires_initialization():
    if torch.distributed.is_initialized():
        pytest.skip("a process group already exists")
    with pytest.raises(CommunicatorError, match="initialize"):
        NcclCommunicator()


def test_cuda_profiles_select_cuda_and_let_the_platform_pick_backends():
    # auto: the CUDA platform prefers triton_flash, and triton_mla for MLA layers (DeepSeek)
    for name in ("cuda", "deepseek"):
        profile = load_profile(name)
        assert profile.platform == "cuda" and profile.attention_backend == "auto"
        assert {"platform-cuda", "attention-flash", "kernels-triton"} <= set(profile.plugins)
    assert "models-deepseek" in load_profile("deepseek").plugins


def test_auto_detection_prefers_cuda_only_when_present():
    plugins = load_plugins(["platform-cpu", "platform-cuda"])
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert select_platform("auto", plugins).name == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_named_cuda_without_gpu_is_a_clear_error():
    with pytest.raises(PlatformError, match="not available"):
        select_platform("cuda", load_plugins(["platform-cuda"]))


@pytest.mark.cuda
@needs_cuda
def test_device_selection_and_bad_rank():
    p = CudaPlatform()
    assert p.device(0) == torch.device("cuda", 0) and torch.cuda.current_device() == 0
    with pytest.raises(PlatformError, match="local rank"):
        p.device(torch.cuda.device_count())


@pytest.mark.cuda
@needs_cuda
def test_peak_memory_measures_an_allocation():
    p = CudaPlatform()
    p.empty_cache()
    p.reset_peak_memory_stats()
    before = p.memory_allocated()
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del x
    assert p.peak_memory_allocated() - before >= 64 << 20


@pytest.mark.cuda
@needs_cuda
def test_nccl_single_rank_collectives(tmp_path):
    comm = NcclCommunicator.initialize(rank=0, world_size=1, init_method=f"file://{tmp_path}/rendezvous")
    try:
        t = torch.arange(4.0, device="cuda")
        assert torch.equal(comm.all_reduce(t), torch.arange(4.0, device="cuda"))
        assert comm.all_gather(t).shape == (4,)
        comm.broadcast(t)
        comm.barrier()
        with pytest.raises(CommunicatorError, match="communicator is on"):
            comm.all_reduce(torch.ones(2))
    finally:
        comm.destroy()
