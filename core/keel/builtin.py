"""The core's own plugin manifest: built-in components registered exactly like a plugin's.

Entry point `core = "keel.builtin:manifest"` in the root pyproject.toml; always loaded. Imports nothing
heavy: the references are resolved only when a component is selected.
"""

from __future__ import annotations

from keel.plugins.manifest import PluginManifest
from keel.version import CORE_API_VERSION, __version__

_SINGLE_TYPE = "keel.kv_cache.single_type"


def manifest() -> PluginManifest:
    return PluginManifest(
        name="core",
        version=__version__,
        core_api=f"=={CORE_API_VERSION}",
        description="keel core built-ins (KV cache spec kinds, n-gram drafts, uni/mp executors, the logging stat logger)",
        provides={
            "kv_cache_spec": {
                "full_attention": f"{_SINGLE_TYPE}:FullAttentionManager",
                "sliding_window": f"{_SINGLE_TYPE}:SlidingWindowManager",
                # MLA latent caches grow with the context like full attention: one latent per token.
                "mla_latent": f"{_SINGLE_TYPE}:FullAttentionManager",
            },
            # Model-free draft methods; model-specific ones (MTP) come from model plugins.
            "spec_decoder": {"ngram": "keel.spec_decode.ngram:NgramProposer"},
            # How the engine core drives its workers; multi-host executors (ray) come from plugins.
            "executor": {
                "uni": "keel.distributed.uni_executor:UniProcExecutor",
                "mp": "keel.distributed.mp_executor:MultiprocExecutor",
            },
            # The server's periodic throughput line (off with --disable-log-stats); prometheus is endpoints'.
            "stat_logger": {"logging": "keel.metrics.logging_logger:LoggingStatLogger"},
        },
    )
