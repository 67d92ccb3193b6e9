"""keel-executor-ray: the "ray" executor. The manifest imports nothing heavy (no ray, no torch)."""

from keel.plugins.manifest import PluginManifest

__version__ = "0.1.0"


def manifest() -> PluginManifest:
    return PluginManifest(
        name="executor-ray",
        version=__version__,
        core_api=">=1.0,<2",
        description="workers as Ray actors (one per device) on a running or local Ray cluster",
        provides={"executor": {"ray": "keel_executor_ray.executor:RayExecutor"}},
    )
