"""The core imports no kernel language: Triton kernels (elementwise ops, fused MoE, attention) live in
plugins and reach the core through its registries. Checked on the source, so an import hidden in a
function or behind a try counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import keel

CORE = Path(keel.__file__).resolve().parent
KERNEL_LANGUAGES = ("triton",)


def _imported_roots(tree: ast.AST) -> set[str]:
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                roots.add(node.args[0].value.split(".")[0])
    return roots


def test_no_core_module_imports_triton():
    files = sorted(CORE.rglob("*.py"))
    assert len(files) > 50  # the whole core package, not an empty folder
    offenders = {str(f.relative_to(CORE)): sorted(_imported_roots(ast.parse(f.read_text())) & set(KERNEL_LANGUAGES))
                 for f in files}
    assert {f: langs for f, langs in offenders.items() if langs} == {}


def test_the_check_sees_every_import_form():
    src = "import triton.language as tl\nfrom triton import jit\nimportlib.import_module('triton')\n"
    for line in src.splitlines():
        assert "triton" in _imported_roots(ast.parse(line))
    assert "triton" not in _imported_roots(ast.parse("from .triton import x\n'import triton'"))
