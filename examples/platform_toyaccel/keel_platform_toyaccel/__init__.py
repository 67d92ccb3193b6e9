"""Manifest of the example platform plugin. Imports only keel.plugins.manifest: discovery stays cheap."""

from keel.plugins.manifest import PluginManifest

__version__ = "0.1.0"


def manifest() -> PluginManifest:
    return PluginManifest(
        name="platform-toyaccel",
        version=__version__,
        core_api=">=1.0,<2",
        description="ToyAccel: a simulated accelerator that computes on the host",
        provides={"platform": {"toyaccel": "keel_platform_toyaccel.platform:ToyAccelPlatform"}},
    )
