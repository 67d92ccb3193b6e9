"""keel-models-llama: Llama, Mistral, Qwen2 and Qwen3 dense models for keel.

This module is the plugin's entry point and is imported at discovery: it must import nothing heavy
(no torch); model classes are referenced lazily as "module:attr" strings.
"""

from keel.plugins.manifest import PluginManifest

__version__ = "0.1.0"


def manifest() -> PluginManifest:
    return PluginManifest(
        name="models-llama",
        version=__version__,
        core_api=">=1.0,<2",
        provides={
            "model_arch": {
                "LlamaForCausalLM": "keel_models_llama.llama:LlamaForCausalLM",
                "MistralForCausalLM": "keel_models_llama.mistral:MistralForCausalLM",
                "Qwen2ForCausalLM": "keel_models_llama.qwen2:Qwen2ForCausalLM",
                "Qwen3ForCausalLM": "keel_models_llama.qwen3:Qwen3ForCausalLM",
                # embedding (pooling) models: the base decoders without an LM head
                "LlamaModel": "keel_models_llama.embedding:LlamaEmbeddingModel",
                "Qwen2Model": "keel_models_llama.embedding:LlamaEmbeddingModel",
                "Qwen3Model": "keel_models_llama.embedding:Qwen3EmbeddingModel",
            }
        },
        description="Llama-family dense decoders: Llama 2/3/3.1, Mistral, Qwen2, Qwen3",
    )
