"""Install keel and its plugins from this checkout in about a second, for device calls: what an editable pip
install leaves behind, written directly -- a .pth naming the source folders and one dist-info per
distribution (METADATA, entry_points.txt, RECORD) -- without building anything. On a fresh GPU machine
`pip install --no-deps --no-build-isolation -e . -e plugins/...` took ~50 s of device time per start.

    python3 benchmarks/fast_install.py [--site DIR]     (default: the interpreter's first site-packages)

Plugin discovery reads entry points from the dist-infos (importlib.metadata), imports resolve through
the .pth (site-packages processes .pth files; a PYTHONPATH folder would not). Dependencies are not
installed or checked: the device's python has them (torch, triton, transformers), as with --no-deps.
"""

from __future__ import annotations

import argparse
import re
import site
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PTH = "__keel_fast_install.pth"


def distributions(root: Path = ROOT) -> list[dict]:
    """(name, version, source folder, entry points by group) of keel and every plugin under plugins/."""
    out = []
    for pyproject in [root / "pyproject.toml", *sorted(root.glob("plugins/*/pyproject.toml"))]:
        data = tomllib.loads(pyproject.read_text())
        project = data["project"]
        package_dir = data.get("tool", {}).get("setuptools", {}).get("package-dir", {}).get("", ".")
        groups = {g: dict(eps) for g, eps in project.get("entry-points", {}).items()}
        if project.get("scripts"):
            groups["console_scripts"] = dict(project["scripts"])
        out.append({"name": project["name"], "version": project["version"],
                    "source": (pyproject.parent / package_dir).resolve(), "entry_points": groups})
    return out


def install(site_dir: Path, root: Path = ROOT) -> list[str]:
    """Write the .pth and the dist-infos into `site_dir`, replacing earlier ones of the same names."""
    site_dir.mkdir(parents=True, exist_ok=True)
    dists = distributions(root)
    (site_dir / PTH).write_text("".join(f"{d['source']}\n" for d in dists))
    for d in dists:
        norm = re.sub(r"[-_.]+", "_", d["name"]).lower()
        for old in site_dir.glob(f"{norm}-*.dist-info"):
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
        info = site_dir / f"{norm}-{d['version']}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {d['name']}\nVersion: {d['version']}\n")
        (info / "INSTALLER").write_text("keel-fast-install\n")
        (info / "entry_points.txt").write_text("".join(
            f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
            for group, eps in d["entry_points"].items()))
        (info / "RECORD").write_text("".join(f"{info.name}/{f},,\n" for f in
                                             ("METADATA", "INSTALLER", "entry_points.txt", "RECORD")))
    return [d["name"] for d in dists]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--site", type=Path, default=None)
    a = ap.parse_args()
    target = a.site or Path(site.getsitepackages()[0])
    names = install(target)
    print(f"fast install into {target}: {', '.join(names)}", file=sys.stderr)


if __name__ == "__main__":
    main()
