import os
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

# The suite pins its platform: the in-tree one this machine has (what `platform: auto` picks among keel's
# own), so an installed third-party platform -- docs/plugins.md's example -- never changes its results.
# Tests of auto-detection clear it. A run may pin another one by setting KEEL_PLATFORM itself.
if "KEEL_PLATFORM" not in os.environ:
    import torch

    os.environ["KEEL_PLATFORM"] = "cuda" if torch.cuda.is_available() else "cpu"

# --import-mode=importlib does not put test directories on sys.path; helper modules beside these tests
# (kv_test_utils) are imported by name.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def pytest_sessionfinish(session, exitstatus):
    """No engine-core process outlives the run. multiprocessing's exit handler terminates and then
    joins every child without a timeout, so one left behind by a failed test -- or stopped with SIGSTOP,
    where SIGTERM waits for a SIGCONT -- would keep the interpreter from ever exiting."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=5)


@pytest.fixture
def fake_plugins(tmp_path, monkeypatch):
    """Factory for fake installed plugins: `<dist>.dist-info/{METADATA,entry_points.txt}` plus a package
    in a temp dir on sys.path, found by importlib.metadata like a pip-installed distribution.

    make(name, provides={...}, core_api=..., body="", files={...}, hooks=(), dist=None) -> package name.
    `make.path` is the directory (pass `path=[make.path]` to discovery to see only the fakes + core).
    """
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))

    def make(name, provides=None, core_api=">=1.0,<2", body="", files=None, hooks=(), dist=None,
             manifest_src=None, version="1.2.3"):
        pkg = f"fake_{name.replace('-', '_')}_{uuid.uuid4().hex[:8]}"
        dist = dist or f"keel-{name}-{pkg[-8:]}"
        (site / pkg).mkdir()
        provides = {
            kind: {key: ref.replace("PKG", pkg) for key, ref in keys.items()}
            for kind, keys in (provides or {}).items()
        }
        hooks = tuple(h.replace("PKG", pkg) for h in hooks)
        manifest_src = manifest_src or (
            f"def manifest():\n    return PluginManifest(name={name!r}, version={version!r}, "
            f"core_api={core_api!r}, provides={provides!r}, hooks={hooks!r})\n"
        )
        header = "from keel.plugins.manifest import PluginManifest\n"
        init = header + textwrap.dedent(body) + "\n" + manifest_src
        (site / pkg / "__init__.py").write_text(init)
        for rel, text in (files or {}).items():
            (site / pkg / rel).write_text(textwrap.dedent(text))
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[keel.plugins]\n{name} = {pkg}:manifest\n")
        return pkg

    make.path = str(site)
    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 1-layer random Llama (vocab 512) with the local test tokenizer, shared by the tests that only
    need some real model behind the engine."""
    from keel.testing.checkpoints import make_checkpoint
    from keel.testing.tokenizer import build_tokenizer

    path = tmp_path_factory.mktemp("tiny-model")
    make_checkpoint("llama", path, vocab_size=512, num_hidden_layers=1)
    build_tokenizer(path)
    return str(path)
