from pathlib import Path

import pytest

from keel.profile import DEFAULT_PROFILE, ProfileError, find_profile, load_profile, parse_profile

REPO = Path(__file__).resolve().parents[1]


def test_shipped_profiles_are_valid():
    cpu = load_profile(str(REPO / "profiles" / "cpu.yaml"))
    assert {"platform-cpu", "attention-torch", "models-llama"} <= set(cpu.plugins) and cpu.platform == "cpu"
    from keel.plugins.discovery import discover

    installed = {p.name for p in discover()}
    assert set(cpu.plugins) <= installed, f"cpu profile names uninstalled plugins: {set(cpu.plugins) - installed}"
    assert cpu.engine["block_size"] == 16
    default = load_profile(str(REPO / "profiles" / "default.yaml"))
    assert (default.plugins, default.platform, default.attention_backend) == ("auto", "auto", "auto")


def test_builtin_default_is_auto():
    assert (DEFAULT_PROFILE.plugins, DEFAULT_PROFILE.platform, DEFAULT_PROFILE.attention_backend) == (
        "auto", "auto", "auto")


def test_find_by_name_in_profile_path(tmp_path, monkeypatch):
    (tmp_path / "edge.yaml").write_text("plugins: [platform-cpu]\n")
    monkeypatch.setenv("KEEL_PROFILE_PATH", str(tmp_path))
    assert find_profile("edge") == tmp_path / "edge.yaml"
    assert load_profile("edge").plugins == ("platform-cpu",)


def test_unknown_profile_name_suggests(tmp_path, monkeypatch):
    (tmp_path / "edge.yaml").write_text("{}\n")
    monkeypatch.setenv("KEEL_PROFILE_PATH", str(tmp_path))
    with pytest.raises(ProfileError, match="did you mean 'edge'"):
        find_profile("egde")
    with pytest.raises(ProfileError, match="does not exist"):
        find_profile(str(tmp_path / "missing.yaml"))


def test_unknown_top_level_key_suggests_nearest():
    with pytest.raises(ProfileError) as err:
        parse_profile({"plugin": ["platform-cpu"]}, "p")
    assert "unknown key 'plugin'" in str(err.value) and "did you mean 'plugins'" in str(err.value)


def test_unknown_engine_key_suggests_nearest():
    with pytest.raises(ProfileError) as err:
        parse_profile({"engine": {"blok_size": 16}}, "p")
    assert "'blok_size'" in str(err.value) and "did you mean 'block_size'" in str(err.value)


def test_engine_value_types_checked():
    with pytest.raises(ProfileError, match=r"engine.block_size: expected int"):
        parse_profile({"engine": {"block_size": "16"}}, "p")
    with pytest.raises(ProfileError, match=r"engine.enforce_eager: expected bool"):
        parse_profile({"engine": {"enforce_eager": 1}}, "p")
    assert parse_profile({"engine": {"gpu_memory_utilization": 1}}, "p").engine["gpu_memory_utilization"] == 1


def test_top_level_settings_not_allowed_under_engine():
    with pytest.raises(ProfileError, match="top-level profile key"):
        parse_profile({"engine": {"platform": "cpu"}}, "p")


def test_plugins_must_be_list_or_auto():
    with pytest.raises(ProfileError, match="'plugins' must be 'auto' or a list"):
        parse_profile({"plugins": "platform-cpu"}, "p")
    with pytest.raises(ProfileError, match="'platform' must be a non-empty string"):
        parse_profile({"platform": 3}, "p")
    with pytest.raises(ProfileError, match="expected a mapping"):
        parse_profile(["plugins"], "p")


def test_invalid_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("plugins: [a, b\n")
    with pytest.raises(ProfileError, match="not valid YAML"):
        load_profile(str(bad))
