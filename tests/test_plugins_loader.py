import logging

import pytest

from keel.plugins.errors import DuplicateKeyError, PluginLoadError, UnknownKeyError
from keel.plugins.loader import load_plugins
from keel.plugins.manifest import KINDS

COMPONENT = "class Thing:\n    pass\n"


def test_named_plugin_not_installed(fake_plugins):
    fake_plugins("attention-fast")
    with pytest.raises(PluginLoadError) as err:
        load_plugins(["attention-fats"], path=[fake_plugins.path])
    msg = str(err.value)
    assert "'attention-fats'" in msg and "not installed" in msg and "did you mean 'attention-fast'" in msg
    assert err.value.distribution is None


def test_named_plugin_import_error_names_plugin_distribution_cause(fake_plugins):
    fake_plugins("platform-npu", body="raise RuntimeError('driver 12.1 required')", dist="keel-platform-npu")
    with pytest.raises(PluginLoadError) as err:
        load_plugins(["platform-npu"], path=[fake_plugins.path])
    msg = str(err.value)
    assert "'platform-npu'" in msg and "keel-platform-npu" in msg and "driver 12.1 required" in msg


def test_named_plugin_raising_while_loading_manifest(fake_plugins):
    fake_plugins("loadfail", manifest_src="def manifest():\n    raise ValueError('bad config file')\n")
    with pytest.raises(PluginLoadError, match="bad config file"):
        load_plugins(["loadfail"], path=[fake_plugins.path])


def test_named_plugin_incompatible_core_api(fake_plugins):
    fake_plugins("oldplug", core_api="<1.0")
    with pytest.raises(PluginLoadError, match="incompatible core API"):
        load_plugins(["oldplug"], path=[fake_plugins.path])


def test_named_plugin_hook_import_failure(fake_plugins):
    fake_plugins("hooky", hooks=("PKG.hooks:impl",), files={"hooks.py": "raise OSError('no socket')\n"})
    with pytest.raises(PluginLoadError, match="no socket"):
        load_plugins(["hooky"], path=[fake_plugins.path])


def test_auto_skips_broken_with_warning(fake_plugins, caplog):
    fake_plugins("good", provides={"endpoint": {"hello": "PKG.c:Thing"}}, files={"c.py": COMPONENT})
    fake_plugins("bad", body="raise ImportError('nope')")
    with caplog.at_level(logging.WARNING, logger="keel.plugins"):
        plugins = load_plugins("auto", path=[fake_plugins.path])
    assert set(plugins.names) == {"core", "good"} and plugins.auto
    assert [p.name for p in plugins.skipped] == ["bad"]
    assert "'bad'" in caplog.text and "nope" in caplog.text


def test_core_is_always_loaded_first(fake_plugins):
    fake_plugins("solo")
    plugins = load_plugins(["solo"], path=[fake_plugins.path])
    assert plugins.names == ["core", "solo"]
    assert "full_attention" in plugins.registry("kv_cache_spec")


def test_duplicate_key_names_both_providers(fake_plugins):
    fake_plugins("one", provides={"platform": {"npu": "PKG:A"}}, dist="keel-one")
    fake_plugins("two", provides={"platform": {"npu": "PKG:B"}}, dist="keel-two")
    with pytest.raises(DuplicateKeyError) as err:
        load_plugins(["one", "two"], path=[fake_plugins.path])
    msg = str(err.value)
    assert "'npu'" in msg and "'one' (keel-one)" in msg and "'two' (keel-two)" in msg


def test_every_registry_kind(fake_plugins):
    provides = {kind: {f"{kind}_key": "PKG.c:Thing"} for kind in KINDS if kind != "kv_cache_spec"}
    provides["kv_cache_spec"] = {"state_space": "PKG.c:Thing"}
    pkg = fake_plugins("everything", provides=provides, files={"c.py": COMPONENT})
    plugins = load_plugins(["everything"], path=[fake_plugins.path])
    for kind in KINDS:
        reg = plugins.registry(kind)
        key = "state_space" if kind == "kv_cache_spec" else f"{kind}_key"
        assert key in reg.keys() and key in reg  # noqa: SIM118 -- both spellings are API
        assert reg.get(key).__name__ == "Thing" and reg.get(key).__module__ == f"{pkg}.c"
        assert reg.provider(key).plugin == "everything"


def test_unknown_key_lists_available_and_suggests(fake_plugins):
    fake_plugins("plat", provides={"platform": {"npu": "PKG:X", "tpu": "PKG:Y"}})
    reg = load_plugins(["plat"], path=[fake_plugins.path]).registry("platform")
    with pytest.raises(KeyError) as err:
        reg.get("npuu")
    assert isinstance(err.value, UnknownKeyError)
    assert "did you mean 'npu'" in str(err.value) and "npu, tpu" in str(err.value)


def test_unknown_kind(fake_plugins):
    plugins = load_plugins([], path=[fake_plugins.path])
    with pytest.raises(ValueError, match="did you mean 'platform'"):
        plugins.registry("platfom")


def test_component_import_failure_is_plugin_load_error(fake_plugins):
    fake_plugins("lazy", provides={"attention_backend": {"fast": "PKG.k:Kernel"}},
                 files={"k.py": "raise ImportError('triton missing')\n"}, dist="keel-lazy")
    plugins = load_plugins(["lazy"], path=[fake_plugins.path])  # nothing imported yet: loads fine
    with pytest.raises(PluginLoadError) as err:
        plugins.registry("attention_backend").get("fast")
    assert "'lazy'" in str(err.value) and "keel-lazy" in str(err.value) and "triton missing" in str(err.value)


def test_hooks_are_registered_and_called(fake_plugins):
    hooks = """
        from keel.plugins.hookspecs import hookimpl

        class Impl:
            calls = []

            @hookimpl
            def keel_shutdown(self):
                Impl.calls.append("shutdown")

        impl = Impl()
    """
    pkg = fake_plugins("lifecycle", hooks=("PKG.hooks:impl",), files={"hooks.py": hooks})
    plugins = load_plugins(["lifecycle"], path=[fake_plugins.path])
    plugins.hooks.hook.keel_shutdown()
    import importlib

    assert importlib.import_module(f"{pkg}.hooks").Impl.calls == ["shutdown"]
