"""keel plugin `logits-processors`: `logits_processor` "no_repeat_ngram".

Only the manifest lives here; discovery imports this module.
"""

from keel.plugins.manifest import PluginManifest

__version__ = "0.1.0"


def manifest() -> PluginManifest:
    """Entry point `logits-processors` in group `keel.plugins`; called by plugin discovery."""
    return PluginManifest(
        name="logits-processors",
        version=__version__,
        core_api=">=1.0,<2",
        provides={"logits_processor": {
            "no_repeat_ngram": "keel_logits_processors.no_repeat_ngram:NoRepeatNGramLogitsProcessor"}},
        description="Batch-level logits processors (vLLM v1 interface): no_repeat_ngram.",
    )
