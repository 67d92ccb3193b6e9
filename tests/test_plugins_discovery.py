import sys

from keel.plugins.discovery import discover


def _by_name(plugins, name):
    (found,) = [p for p in plugins if p.name == name]
    return found


def test_discovers_fake_distribution(fake_plugins):
    pkg = fake_plugins("platform-fake", provides={"platform": {"fake": "PKG.impl:Fake"}})
    plugins = discover(path=[fake_plugins.path])
    p = _by_name(plugins, "platform-fake")
    assert p.ok and p.distribution.startswith("keel-platform-fake") and p.version == "1.2.3"
    assert dict(p.manifest.provides["platform"]) == {"fake": f"{pkg}.impl:Fake"}
    assert f"{pkg}.impl" not in sys.modules  # nothing but the manifest is imported


def test_core_plugin_always_present():
    plugins = discover(path=[])
    core = _by_name(plugins, "core")
    assert core.ok and core.distribution == "keel"
    assert set(core.manifest.provides["kv_cache_spec"]) == {"full_attention", "sliding_window", "mla_latent"}


def test_core_found_through_entry_point_when_installed():
    core = _by_name(discover(), "core")
    assert core.value == "keel.builtin:manifest" and core.ok


def test_manifest_constant_is_accepted(fake_plugins):
    src = "manifest = PluginManifest(name='const', version='1', core_api='>=1.0')\n"
    fake_plugins("const", manifest_src=src)
    assert _by_name(discover(path=[fake_plugins.path]), "const").ok


def test_import_error_recorded_not_raised(fake_plugins):
    fake_plugins("broken", body="raise ImportError('missing libfoo.so')")
    p = _by_name(discover(path=[fake_plugins.path]), "broken")
    assert not p.ok and "ImportError: missing libfoo.so" in p.error


def test_manifest_of_wrong_type(fake_plugins):
    fake_plugins("wrongtype", manifest_src="def manifest():\n    return {'name': 'wrongtype'}\n")
    p = _by_name(discover(path=[fake_plugins.path]), "wrongtype")
    assert "must yield a PluginManifest" in p.error


def test_incompatible_and_invalid_core_api(fake_plugins):
    fake_plugins("future", core_api=">=2.0")
    fake_plugins("garbled", core_api="one point oh")
    plugins = discover(path=[fake_plugins.path])
    assert "incompatible core API" in _by_name(plugins, "future").error
    assert "invalid core_api range" in _by_name(plugins, "garbled").error


def test_manifest_name_must_match_entry_point(fake_plugins):
    src = "def manifest():\n    return PluginManifest(name='other', version='1', core_api='>=1')\n"
    fake_plugins("mismatch", manifest_src=src)
    plugin = _by_name(discover(path=[fake_plugins.path]), "mismatch")
    assert "differs from its entry-point name" in plugin.error


def test_unknown_kind_and_malformed_ref(fake_plugins):
    fake_plugins("badkind", provides={"platfrom": {"x": "PKG:X"}})
    fake_plugins("badref", provides={"platform": {"x": "no_colon_here"}})
    plugins = discover(path=[fake_plugins.path])
    assert "unknown kind 'platfrom'" in _by_name(plugins, "badkind").error
    assert "did you mean 'platform'" in _by_name(plugins, "badkind").error
    assert "malformed reference" in _by_name(plugins, "badref").error


def test_entry_point_name_claimed_twice(fake_plugins):
    fake_plugins("twin", dist="keel-twin-a")
    fake_plugins("twin", dist="keel-twin-b")
    twins = [p for p in discover(path=[fake_plugins.path]) if p.name == "twin"]
    assert len(twins) == 2 and all("claimed by" in p.error for p in twins)
