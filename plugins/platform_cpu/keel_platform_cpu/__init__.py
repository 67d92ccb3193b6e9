"""keel-platform-cpu: the embedded default platform. The manifest imports nothing heavy."""

from keel.plugins.manifest import PluginManifest

__version__ = "0.1.0"


def manifest() -> PluginManifest:
    return PluginManifest(
        name="platform-cpu",
        version=__version__,
        core_api=">=1.0,<2",
        description="CPU platform (torch on the host, gloo for collectives)",
        provides={"platform": {"cpu": "keel_platform_cpu.platform:CpuPlatform"}},
    )
