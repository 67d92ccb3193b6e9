"""keel plugin `structured-output-xgrammar`: the `structured_output` backend "xgrammar".

Only the manifest lives here; discovery imports this module, so it must not import xgrammar.
"""

from keel.plugins.manifest import PluginManifest

__version__ = "0.1.0"


def manifest() -> PluginManifest:
    """Entry point `structured-output-xgrammar` in group `keel.plugins`; called by plugin discovery."""
    return PluginManifest(
        name="structured-output-xgrammar",
        version=__version__,
        core_api=">=1.0,<2",
        provides={"structured_output": {"xgrammar": "keel_structured_output_xgrammar.backend:XGrammarBackend"}},
        description="Structured outputs with xgrammar: JSON schema / object, regex, choice, EBNF grammar.",
    )
