import pytest
from keel_platform_cpu.platform import CpuPlatform, _meminfo

from keel.config import EngineArgs, EngineConfig
from keel.platform import select_platform
from keel.plugins.loader import load_plugins
from keel.testing.platform import PlatformConformance


class TestCpuPlatformConformance(PlatformConformance):
    platform_cls = CpuPlatform
    entry_point = "platform-cpu"


def test_identity_and_preference():
    p = CpuPlatform()
    assert (p.name, p.device_type, p.dist_backend) == ("cpu", "cpu", "gloo")
    assert p.attention_backend_preference() == ["torch_paged", "torch_mla", "triton_flash", "triton_mla"]
    assert not p.supports_graph_capture and not p.graph_capture().supported


def test_memory_matches_proc_meminfo():
    info = _meminfo()
    if "MemTotal" not in info:
        pytest.skip("no /proc/meminfo")
    assert CpuPlatform().total_memory() == info["MemTotal"]


def test_adjust_config_forces_eager():
    patch = CpuPlatform().adjust_config(EngineConfig(model=None))
    assert patch == {"device": {"enforce_eager": True}}


def test_auto_detect_picks_cpu_when_alone():
    plugins = load_plugins(["platform-cpu"])
    assert isinstance(select_platform("auto", plugins), CpuPlatform)


def test_engine_config_resolves_cpu():
    config = EngineArgs(plugins=["platform-cpu"]).create_engine_config(require_model=False)
    assert config.device.platform == "cpu" and config.device.enforce_eager
