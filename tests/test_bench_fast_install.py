"""benchmarks/fast_install.py (device calls' ~1 s install): a .pth naming every source folder and one dist-info per
distribution whose entry points are the pyproject's, readable by importlib.metadata as plugin discovery reads them."""

from __future__ import annotations

import importlib.metadata as md
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import fast_install  # noqa: E402


def test_every_distribution_and_entry_point_is_written(tmp_path):
    names = fast_install.install(tmp_path)
    pyprojects = [ROOT / "pyproject.toml", *sorted(ROOT.glob("plugins/*/pyproject.toml"))]
    assert len(names) == len(pyprojects) and "keel" in names
    sources = (tmp_path / fast_install.PTH).read_text().split()
    assert str(ROOT / "core") in sources and all(Path(s).is_dir() for s in sources)
    dists = {d.metadata["Name"]: d for d in md.distributions(path=[str(tmp_path)])}
    assert set(dists) == set(names)
    for pyproject in pyprojects:
        project = tomllib.loads(pyproject.read_text())["project"]
        d = dists[project["name"]]
        assert d.version == project["version"]
        want = {(g, k, v) for g, eps in project.get("entry-points", {}).items() for k, v in eps.items()}
        assert want <= {(ep.group, ep.name, ep.value) for ep in d.entry_points}
    fast_install.install(tmp_path)  # again: replaced, not duplicated
    assert len(list(tmp_path.glob("*.dist-info"))) == len(names)
