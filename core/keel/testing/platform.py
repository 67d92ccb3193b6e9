"""Conformance suite for platform plugins: subclass `PlatformConformance` and set `platform_cls`.

    from keel.testing.platform import PlatformConformance
    from my_plugin.platform import MyPlatform

    class TestMyPlatform(PlatformConformance):
        platform_cls = MyPlatform
        entry_point = "platform-mine"   # optional: also checks the installed manifest

Tests that need the device are skipped when `is_available()` is False, so the suite runs anywhere.
"""

from __future__ import annotations

import copy
from typing import ClassVar

import pytest
import torch

from keel.platform import CommunicatorSpec, GraphCaptureSpec, Platform


class PlatformConformance:
    platform_cls: ClassVar[type[Platform] | None] = None
    entry_point: ClassVar[str | None] = None  # the plugin's entry-point name, if installed

    @pytest.fixture
    def platform(self) -> Platform:
        if self.platform_cls is None:
            pytest.fail("set `platform_cls` on your PlatformConformance subclass")
        return self.platform_cls()

    @pytest.fixture
    def available(self, platform: Platform) -> Platform:
        if not type(platform).is_available():
            pytest.skip(f"platform {platform.name!r} is not available on this machine")
        return platform

    def test_is_platform_subclass(self) -> None:
        assert isinstance(self.platform_cls, type) and issubclass(self.platform_cls, Platform)

    def test_identity(self, platform: Platform) -> None:
        assert isinstance(platform.name, str) and platform.name and platform.name != "auto"
        assert isinstance(platform.device_type, str) and platform.device_type
        torch.device(platform.device_type)  # a device type torch knows
        assert isinstance(platform.dist_backend, str) and platform.dist_backend
        assert isinstance(platform.priority, int) and not isinstance(platform.priority, bool)

    def test_is_available_is_bool_and_stable(self) -> None:
        first = self.platform_cls.is_available()
        assert isinstance(first, bool)
        assert self.platform_cls.is_available() == first

    def test_capabilities(self, platform: Platform) -> None:
        assert platform.supported_dtypes, "supported_dtypes must not be empty"
        assert all(isinstance(d, torch.dtype) for d in platform.supported_dtypes)
        assert isinstance(platform.supports_fp8, bool)
        assert isinstance(platform.supports_graph_capture, bool)

    def test_device(self, available: Platform) -> None:
        device = available.device(0)
        assert isinstance(device, torch.device) and device.type == available.device_type
        x = torch.ones(4, device=device)  # the device really works
        assert float(x.sum()) == 4.0

    def test_supported_dtypes_compute(self, available: Platform) -> None:
        device = available.device(0)
        for dtype in available.supported_dtypes:
            a = torch.ones(2, 3, dtype=dtype, device=device)
            assert (a @ a.T).dtype == dtype

    def test_memory(self, available: Platform) -> None:
        total, free = available.total_memory(0), available.free_memory(0)
        assert isinstance(total, int) and isinstance(free, int)
        assert total > 0 and 0 <= free <= total

    def test_synchronize_and_empty_cache(self, available: Platform) -> None:
        available.synchronize(0)
        available.empty_cache()

    def test_adjust_config_returns_patch_without_mutating(self, platform: Platform) -> None:
        from keel.config import EngineConfig

        config = EngineConfig(model=None)
        before = copy.deepcopy(config.to_dict())
        patch = platform.adjust_config(config)
        assert isinstance(patch, dict)
        assert config.to_dict() == before, "adjust_config must return a patch, not edit the config"
        patched = config.with_patch(patch)  # the patch names real sections and fields
        assert isinstance(patched, EngineConfig)

    def test_attention_backend_preference(self, platform: Platform) -> None:
        pref = platform.attention_backend_preference()
        assert isinstance(pref, list) and all(isinstance(k, str) and k for k in pref)
        assert len(set(pref)) == len(pref), "preference lists a backend twice"

    def test_communicator(self, platform: Platform) -> None:
        comm = platform.communicator()
        assert isinstance(comm, CommunicatorSpec) and comm.dist_backend

    def test_graph_capture_consistent(self, platform: Platform) -> None:
        spec = platform.graph_capture()
        assert isinstance(spec, GraphCaptureSpec)
        if not platform.supports_graph_capture:
            assert not spec.supported
        assert all(isinstance(b, int) and b > 0 for b in spec.batch_sizes)

    def test_manifest_registers_platform(self) -> None:
        if self.entry_point is None:
            pytest.skip("set `entry_point` to check the installed manifest")
        from keel.plugins.loader import load_plugins

        plugins = load_plugins([self.entry_point])
        registry = plugins.registry("platform")
        assert self.platform_cls.name in registry, f"manifest does not register {self.platform_cls.name!r}"
        assert registry.get(self.platform_cls.name) is self.platform_cls

    def test_selectable_by_name(self) -> None:
        if self.entry_point is None:
            pytest.skip("set `entry_point` to check selection")
        if not self.platform_cls.is_available():
            pytest.skip("platform not available")
        from keel.platform import select_platform
        from keel.plugins.loader import load_plugins

        selected = select_platform(self.platform_cls.name, load_plugins([self.entry_point]))
        assert isinstance(selected, self.platform_cls)
