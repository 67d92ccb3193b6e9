"""Import a script that is not a package module (a benchmark under benchmarks/) so that tests can check the
parts of it that run without its hardware: candidate grids, summaries."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def load_script(path: Path) -> ModuleType:
    """The module of the Python file at `path`, executed once, named after the file."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
