"""Runs keel's platform conformance suite against this plugin (plus plugin-specific tests)."""

from keel_platform_toyaccel.platform import ToyAccelPlatform

from keel.config import EngineConfig
from keel.testing.platform import PlatformConformance


class TestToyAccel(PlatformConformance):
    platform_cls = ToyAccelPlatform
    entry_point = "platform-toyaccel"  # also checks the installed manifest


def test_block_size_is_rounded_to_kernel_tile():
    patch = ToyAccelPlatform().adjust_config(EngineConfig(model=None))
    assert patch["cache"] == {"block_size": 32}
