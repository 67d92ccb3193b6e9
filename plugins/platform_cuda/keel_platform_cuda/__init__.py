"""keel-platform-cuda: NVIDIA GPUs. The manifest imports nothing heavy."""

from keel.plugins.manifest import PluginManifest

__version__ = "0.1.0"


def manifest() -> PluginManifest:
    """Entry point `platform-cuda` in group `keel.plugins`; called by plugin discovery."""
    return PluginManifest(
        name="platform-cuda",
        version=__version__,
        core_api=">=1.0,<2",
        description="NVIDIA GPUs: CUDA devices, NCCL collectives, CUDA-graph decode, memory profiling",
        provides={"platform": {"cuda": "keel_platform_cuda.platform:CudaPlatform"}},
    )
