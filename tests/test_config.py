import pickle

import pytest
import torch

from keel.config import (
    CacheConfig,
    ConfigError,
    DeviceConfig,
    EngineArgs,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama")
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
                      architectures=["LlamaForCausalLM"], dtype="bfloat16")
    cfg.save_pretrained(path)
    return str(path)


def test_model_config_lazy_hf_config_and_derivations(tiny_ckpt):
    mc = ModelConfig(tiny_ckpt)
    assert mc.tokenizer == tiny_ckpt and mc.served_model_name == tiny_ckpt
    assert mc.hf_config.hidden_size == 32 and mc.hf_config is mc.hf_config
    assert mc.torch_dtype == torch.bfloat16  # auto: the checkpoint's
    assert ModelConfig(tiny_ckpt, dtype="half").torch_dtype == torch.float16
    assert mc.derived_max_model_len == 256
    assert ModelConfig(tiny_ckpt, max_model_len=64).derived_max_model_len == 64
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings 256"):
        _ = ModelConfig(tiny_ckpt, max_model_len=1000).derived_max_model_len


def test_auto_dtype_defaults_to_float32(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1, intermediate_size=32,
                vocab_size=64).save_pretrained(tmp_path)
    assert ModelConfig(str(tmp_path)).torch_dtype in (torch.float32,)


@pytest.mark.parametrize("make, field", [
    (lambda: ModelConfig(""), "model.model"),
    (lambda: ModelConfig("m", dtype="fp13"), "model.dtype"),
    (lambda: ModelConfig("m", max_model_len=0), "model.max_model_len"),
    (lambda: CacheConfig(block_size=0), "cache.block_size"),
    (lambda: CacheConfig(gpu_memory_utilization=1.5), "cache.gpu_memory_utilization"),
    (lambda: CacheConfig(num_kv_blocks=-1), "cache.num_kv_blocks"),
    (lambda: SchedulerConfig(max_num_seqs=0), "scheduler.max_num_seqs"),
    (lambda: SchedulerConfig(max_num_batched_tokens=10, enable_chunked_prefill=False, max_model_len=64),
     "scheduler.max_num_batched_tokens"),
    (lambda: ParallelConfig(tensor_parallel_size=0), "parallel.tensor_parallel_size"),
    (lambda: DeviceConfig(platform=""), "device.platform"),
    (lambda: SpeculativeConfig(method="mtp", num_speculative_tokens=0), "speculative.num_speculative_tokens"),
])
def test_section_validation_names_field(make, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        make()


def test_scheduler_budget_default():
    assert SchedulerConfig().max_num_batched_tokens == 2048
    assert SchedulerConfig(enable_chunked_prefill=False, max_model_len=300).max_num_batched_tokens == 300


def test_precedence_defaults_profile_args(tmp_path, tiny_ckpt):
    prof = tmp_path / "p.yaml"
    prof.write_text("plugins: [platform-cpu]\nengine: {block_size: 32, max_num_seqs: 8}\n")
    args = EngineArgs(model=tiny_ckpt, profile=str(prof), max_num_seqs=4)
    values, sources, _ = args.resolve()
    assert (values["block_size"], sources["block_size"]) == (32, "profile")
    assert (values["max_num_seqs"], sources["max_num_seqs"]) == (4, "args")
    assert (values["enable_prefix_caching"], sources["enable_prefix_caching"]) == (True, "default")
    config = args.create_engine_config()
    assert config.cache.block_size == 32 and config.scheduler.max_num_seqs == 4
    assert config.plugins == ("core", "platform-cpu") and config.device.platform == "cpu"
    assert config.device.enforce_eager  # the CPU platform's patch
    assert config.profile_path == str(prof)


def test_model_required(tmp_path):
    with pytest.raises(ConfigError, match="model is not set"):
        EngineArgs(plugins=["platform-cpu"]).create_engine_config()


def test_unknown_attention_backend_is_reported(tiny_ckpt):
    with pytest.raises(KeyError, match="no attention_backend named 'flashy'"):
        args = EngineArgs(model=tiny_ckpt, plugins=["platform-cpu"], attention_backend="flashy")
        args.create_engine_config()


def test_speculative_config_keys_checked(tiny_ckpt):
    args = EngineArgs(model=tiny_ckpt, plugins=["platform-cpu"], speculative_config={"methd": "mtp"})
    with pytest.raises(ConfigError, match="did you mean 'method'"):
        args.create_engine_config()
    ok = EngineArgs(model=tiny_ckpt, plugins=["platform-cpu"],
                    speculative_config={"method": "mtp", "num_speculative_tokens": 2}).create_engine_config()
    assert ok.speculative == SpeculativeConfig("mtp", 2)


def test_with_patch_validates_and_does_not_mutate():
    config = EngineConfig(model=None)
    patched = config.with_patch({"cache": {"block_size": 32}})
    assert patched.cache.block_size == 32 and config.cache.block_size == 16
    with pytest.raises(ConfigError, match="did you mean 'block_size'"):
        config.with_patch({"cache": {"blocksize": 32}})
    with pytest.raises(ConfigError, match="unknown section"):
        config.with_patch({"kache": {}})
    with pytest.raises(ConfigError, match="cache.block_size"):
        config.with_patch({"cache": {"block_size": -1}})


def test_plugin_hook_adjusts_config(fake_plugins, tiny_ckpt):
    hooks = """
        from keel.plugins.hookspecs import hookimpl

        class Impl:
            @hookimpl
            def keel_adjust_config(self, config):
                return {"scheduler": {"max_num_seqs": 3}}

        impl = Impl()
    """
    fake_plugins("tuner", hooks=("PKG.hooks:impl",), files={"hooks.py": hooks})
    config = EngineArgs(model=tiny_ckpt, plugins=["platform-cpu", "tuner"]).create_engine_config()
    assert config.scheduler.max_num_seqs == 3


def test_config_pickles_without_loaded_plugins(tiny_ckpt):
    config = EngineArgs(model=tiny_ckpt, plugins=["platform-cpu"]).create_engine_config()
    clone = pickle.loads(pickle.dumps(config))
    assert clone == config and "_cached_plugins" not in clone.__dict__
    assert clone.plugin_set().names == ["core", "platform-cpu"]  # a worker reloads the same set


def test_cli_args_round_trip():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--model", "m", "--block-size", "32", "--no-enable-prefix-caching",
                            "--plugins", "platform-cpu,models-llama", "--kv-cache-memory-bytes", "2GiB",
                            "--gpu-memory-utilization", "0.5", "--speculative-config", '{"method": "mtp"}'])
    args = EngineArgs.from_cli_args(ns)
    assert args.model == "m" and args.block_size == 32 and args.enable_prefix_caching is False
    assert args.plugins == ["platform-cpu", "models-llama"] and args.kv_cache_memory_bytes == 2 * 2**30
    assert args.gpu_memory_utilization == 0.5 and args.speculative_config == {"method": "mtp"}
    assert args.max_num_seqs is None  # not set: the profile or default decides


def test_hook_patches_apply_in_plugin_load_order(fake_plugins, tiny_ckpt):
    template = """
        from keel.plugins.hookspecs import hookimpl

        class Impl:
            @hookimpl
            def keel_adjust_config(self, config):
                return {{"scheduler": {{"max_num_seqs": {n}}}}}

        impl = Impl()
    """
    fake_plugins("first", hooks=("PKG.hooks:impl",), files={"hooks.py": template.format(n=5)})
    fake_plugins("second", hooks=("PKG.hooks:impl",), files={"hooks.py": template.format(n=7)})
    config = EngineArgs(model=tiny_ckpt, plugins=["platform-cpu", "first", "second"]).create_engine_config()
    assert config.scheduler.max_num_seqs == 7  # the later plugin's patch is applied last
