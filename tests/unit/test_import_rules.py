"""Imports point down: the layering of the README's "path of one request", enforced.

Every import statement of the packages is read (those inside functions too), so a lazy import
cannot slip past the rules.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Layer → the project layers it may import (itself included). Listed most specific first: a
# module belongs to the first layer its dotted name starts with.
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "shared": ("shared",),
    "gateway": ("gateway", "shared"),
    "worker.engine.tuning": ("worker.engine", "shared"),  # the kernel tuner, above what it times
    "worker.engine": ("worker.engine", "shared"),
    "worker.kv": ("worker.kv", "worker.engine", "shared"),
    "worker.speculative": ("worker.speculative", "shared"),  # drafting: pure, over token ids
    "worker.sched": ("worker.sched", "worker.speculative", "worker.kv", "worker.engine", "shared"),
    "worker": ("worker", "shared"),  # the process: main, service, pulse, numa
    "reame": ("reame", "gateway", "worker", "shared"),  # the CLI wires both sides together
}
# Rooms inside a layer's own package that sit above it: the engine never imports its tuner.
MAY_NOT_IMPORT: dict[str, tuple[str, ...]] = {"worker.engine": ("worker.engine.tuning",)}
PROJECT = ("shared", "gateway", "worker", "reame")
# Third-party packages a layer must never load: the gateway stays free of the engine's compiler,
# the worker of the HTTP stack (JSON, templates and HTTP errors are the gateway's alone).
FORBIDDEN = {"gateway": ("numba",), "worker": ("aiohttp",), "shared": ("numba", "aiohttp")}


def _layer(module: str) -> str:
    for layer in MAY_IMPORT:
        if module == layer or module.startswith(layer + "."):
            return layer
    raise AssertionError(f"{module} is in no layer")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every absolute import in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _violations(path: Path) -> list[str]:
    layer = _layer(_module_name(path))
    bad = []
    for line, module in _imports(path):
        top = module.split(".")[0]
        allowed = (any(module == a or module.startswith(a + ".") for a in MAY_IMPORT[layer])
                   and not any(module == a or module.startswith(a + ".") for a in MAY_NOT_IMPORT.get(layer, ())))
        if top in PROJECT and not allowed:
            bad.append(f"{path.relative_to(REPO)}:{line} ({layer}) imports {module}")
        if top in FORBIDDEN.get(layer.split(".")[0], ()):
            bad.append(f"{path.relative_to(REPO)}:{line} ({layer}) loads {top}")
    return bad


def _sources() -> list[Path]:
    return sorted(p for package in PROJECT for p in (REPO / package).rglob("*.py"))


def test_every_module_imports_only_what_its_layer_may():
    bad = [v for path in _sources() for v in _violations(path)]
    assert not bad, "imports pointing the wrong way:\n" + "\n".join(bad)


@pytest.mark.parametrize("layer, source, target", [
    ("shared", "shared/oops.py", "worker.kv.sequence"),
    ("worker.engine", "worker/engine/oops.py", "worker.sched.sampler"),
    ("worker.kv", "worker/kv/oops.py", "worker.sched.scheduler"),
    ("worker.speculative", "worker/speculative/oops.py", "worker.engine.engine"),
    ("worker.engine.tuning", "worker/engine/tuning/oops.py", "worker.sched.tuning_state"),
    ("worker.engine", "worker/engine/oops.py", "worker.engine.tuning.kernel_tuner"),
    ("gateway", "gateway/oops.py", "numba"),
])
def test_a_wrong_way_import_is_caught(tmp_path, monkeypatch, layer, source, target):
    """The checker itself: each kind of wrong-way import is reported."""
    fake_repo = tmp_path
    path = fake_repo / source
    path.parent.mkdir(parents=True)
    path.write_text(f"def f():\n    import {target}\n", encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "REPO", fake_repo)
    assert _layer(_module_name(path)) == layer
    assert len(_violations(path)) == 1
