"""The out-of-tree example platform plugin, installed into a temporary environment like a vendor would."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "platform_toyaccel"


def _run(args, target, cwd, **extra_env):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])}
    env.pop("KEEL_PLATFORM", None)  # auto-detection as a user's machine does it
    env.pop("TOYACCEL_VISIBLE_DEVICES", None)
    env.update(extra_env)
    return subprocess.run([sys.executable, *args], check=False, capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vendor")
    src = tmp / "src"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp / "site"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "--target", str(target), str(src)], check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return target, src, tmp


def test_listed_after_install(installed):
    target, _, tmp = installed
    result = _run(["-m", "keel.cli", "plugins", "list", "--json"], target, tmp)
    assert result.returncode == 0, result.stderr
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    row = rows["platform-toyaccel"]
    assert row["status"] == "ok" and row["distribution"] == "keel-platform-toyaccel"
    assert row["provides"] == {"platform": ["toyaccel"]}


@pytest.mark.parametrize("platform", ["toyaccel", "auto"])
def test_selected_through_profile(installed, platform):
    target, _, tmp = installed
    profile = tmp / f"vendor-{platform}.yaml"
    profile.write_text(f"plugins: [platform-cpu, platform-toyaccel]\nplatform: {platform}\n")
    result = _run(["-m", "keel.cli", "profile", "show", str(profile), "--json"], target, tmp,
                  TOYACCEL_VISIBLE_DEVICES="0")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["platform_selected"]["name"] == "toyaccel"  # auto: higher priority than cpu
    assert "keel-platform-toyaccel" in out["platform_selected"]["provider"]
    assert out["cache"]["block_size"] == 32  # the platform's config patch was applied


def test_installed_example_never_outranks_the_default_by_accident(installed):
    """Following docs/plugins.md (the example installed, no ToyAccel device) keeps the CPU platform for
    `platform: auto`, and the suite's pin (KEEL_PLATFORM) holds even where the toy is available."""
    target, _, tmp = installed
    profile = tmp / "everything-auto.yaml"
    profile.write_text("plugins: auto\nplatform: auto\n")
    for extra, expected in (({}, "cpu"), ({"KEEL_PLATFORM": "cpu", "TOYACCEL_VISIBLE_DEVICES": "0"}, "cpu"),
                            ({"TOYACCEL_VISIBLE_DEVICES": "0"}, "toyaccel")):
        result = _run(["-m", "keel.cli", "profile", "show", str(profile), "--json"], target, tmp, **extra)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["platform_selected"]["name"] == expected, extra


def test_conformance_suite_passes(installed):
    target, src, tmp = installed
    result = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", str(src / "tests")], target, tmp,
                  TOYACCEL_VISIBLE_DEVICES="0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passed" in result.stdout
