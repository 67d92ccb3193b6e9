"""Every distribution of the repository installs without setuptools' deprecation warnings: an SPDX
`license` string (PEP 639) and a setuptools that reads it (>= 77), also in scripts/install.sh."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECTS = [ROOT / "pyproject.toml", *sorted(ROOT.glob("plugins/*/pyproject.toml")),
              *sorted(ROOT.glob("examples/*/pyproject.toml"))]


@pytest.mark.parametrize("path", PYPROJECTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_spdx_license_and_setuptools_77(path):
    data = tomllib.loads(path.read_text())
    assert data["project"].get("license") == "Apache-2.0"  # a string; a {text = ...} table is deprecated
    assert not [c for c in data["project"].get("classifiers", []) if c.startswith("License ::")]
    assert "setuptools>=77" in data["build-system"]["requires"]


def test_install_script_upgrades_setuptools_to_77():
    script = (ROOT / "scripts" / "install.sh").read_text()
    assert "'setuptools>=77'" in script and "setuptools>=68" not in script
