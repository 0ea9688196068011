"""The benchmarks are a wing: no product module imports :mod:`gpuxfer.bench`."""
from __future__ import annotations

import ast
import pathlib

import gpuxfer

ROOT = pathlib.Path(gpuxfer.__file__).parent
WING = "gpuxfer.bench"
#: the command dispatcher names the bench modules (as strings) and is the only bridge
DISPATCHER = "gpuxfer.cli"


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def wing_imports(source: str, module: str, *, is_package: bool = False) -> list[str]:
    """Every import in ``source`` (module ``module``) that resolves into the wing, or a string naming it."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            if node.level:
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if node.value.startswith(WING + ".") or node.value == WING else []
        found += [n for n in names if n == WING or n.startswith(WING + ".")]
    return found


def test_no_product_module_imports_the_wing():
    offenders = {}
    for path in sorted(ROOT.rglob("*.py")):
        name = module_name(path)
        if name == WING or name.startswith(WING + ".") or name == DISPATCHER:
            continue
        hits = wing_imports(path.read_text(), name, is_package=path.name == "__init__.py")
        if hits:
            offenders[name] = sorted(set(hits))
    assert not offenders, f"product modules importing the benchmark wing: {offenders}"


def test_the_scan_finds_every_way_in():
    kv = "gpuxfer.kv.agent"
    assert wing_imports("from ..bench.kv import grid\n", kv) == ["gpuxfer.bench.kv", "gpuxfer.bench.kv.grid"]
    assert wing_imports("from .. import bench\n", kv) == ["gpuxfer.bench"]
    assert wing_imports("import gpuxfer.bench.pp as B\n", kv) == ["gpuxfer.bench.pp"]
    assert wing_imports("def f():\n    from ...bench import cliutil\n", "gpuxfer.integrations.vllm.worker") == \
        ["gpuxfer.bench", "gpuxfer.bench.cliutil"]
    assert wing_imports("import importlib\nimportlib.import_module('gpuxfer.bench.kernels')\n", kv) == \
        ["gpuxfer.bench.kernels"]
    assert wing_imports("from . import bench\n", "gpuxfer", is_package=True) == ["gpuxfer.bench"]
    assert wing_imports("from .engines import Engine\nimport gpuxfer.benchmarks\n", kv) == []
