"""The package's import graph, read with ``ast``: every import statement is an edge, those inside functions and
``if TYPE_CHECKING:`` blocks included. The benchmark wing is imported by nothing outside it, the KV runtime
imports nothing of the benchmark, no import cycle runs anywhere in the package, and the platforms' components
never import the platform module that owns them. Inside the KV runtime, no module but the agent's
reads the agent's private state: its parts are handed to the modules that use them."""
from __future__ import annotations

import ast
import pathlib

import gpuxfer

ROOT = pathlib.Path(gpuxfer.__file__).parent
WING = "gpuxfer.bench"
RUNTIME = "gpuxfer.kv"
#: the KV runtime's module that owns the agent (the only one that may read its private attributes)
AGENT_MODULE = "gpuxfer.kv.agent"
#: the platform modules, each the owner of its components: no module of the package imports them (the package
#: loads them by name, on demand)
PLATFORM_MODULES = ("gpuxfer.platforms.cuda", "gpuxfer.platforms.rocm", "gpuxfer.platforms.host")

def _inside(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def modules() -> dict[str, pathlib.Path]:
    """``{dotted name: path}`` of every module of the package (a package by its ``__init__``)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(source: str, module: str, known, *, is_package: bool = False) -> set[str]:
    """The modules of ``known`` that ``source`` (module ``module``) imports, anywhere in it."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    def add(name: str) -> None:
        while name and name not in known:           # a name inside a module: the module
            name = name.rpartition(".")[0]
        if name:
            found.add(name)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for a in node.names:
                add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    found.discard(module)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path.read_text(), name, known, is_package=path.name == "__init__.py")
            for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def test_nothing_outside_the_wing_imports_it():
    offenders = {m: sorted(t for t in ts if _inside(t, WING)) for m, ts in graph().items() if not _inside(m, WING)}
    offenders = {m: ts for m, ts in offenders.items() if ts}
    assert not offenders, f"modules outside {WING} importing it: {offenders}"


def test_the_kv_runtime_imports_nothing_of_the_benchmark():
    offenders = {m: sorted(t for t in ts if _inside(t, WING)) for m, ts in graph().items() if _inside(m, RUNTIME)}
    offenders = {m: ts for m, ts in offenders.items() if ts}
    assert not offenders, f"KV runtime modules importing the benchmark: {offenders}"


def test_no_import_cycle():
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_platform_module_is_imported_inside_the_platforms_package():
    offenders = {m: sorted(t for t in ts if t in PLATFORM_MODULES) for m, ts in graph().items()
                 if _inside(m, "gpuxfer.platforms")}
    offenders = {m: ts for m, ts in offenders.items() if ts}
    assert not offenders, f"platforms modules importing a platform module: {offenders}"


def test_the_graph_sees_every_kind_of_import():
    known = {"gpuxfer", "gpuxfer.kv", "gpuxfer.kv.agent", "gpuxfer.kv.control", "gpuxfer.bench",
             "gpuxfer.bench.cliutil", "gpuxfer.errors"}
    src = ("from typing import TYPE_CHECKING\nfrom .control import AGENT_WORDS\nfrom .. import errors\n"
           "if TYPE_CHECKING:\n    from ..bench import cliutil\n"
           "def f():\n    import gpuxfer.errors.sub\n")
    assert imports(src, "gpuxfer.kv.agent", known) == {"gpuxfer.kv.control", "gpuxfer.errors",
                                                       "gpuxfer.bench.cliutil"}
    assert imports("from . import control\n", "gpuxfer.kv", known, is_package=True) == {"gpuxfer.kv.control"}
    assert cycles({"a": {"b"}, "b": {"a", "c"}, "c": set(), "d": {"d"}}) == [["a", "b"]]


def _is_agent(node: ast.AST) -> bool:
    """Whether ``node`` names an agent: ``agent``, ``self.agent`` or ``self._agent``."""
    if isinstance(node, ast.Name):
        return node.id == "agent"
    return (isinstance(node, ast.Attribute) and node.attr in ("agent", "_agent") and isinstance(node.value, ast.Name)
            and node.value.id == "self")


def private_agent_reads(source: str) -> list[str]:
    """``line: code`` of each place ``source`` touches a private attribute of an agent (an attribute, or
    ``getattr`` / ``setattr`` / ``hasattr`` of a literal name, beginning with one underscore)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        name = None
        if isinstance(node, ast.Attribute) and _is_agent(node.value):
            name = node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
              and _is_agent(node.args[0]) and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str)):
            name = node.args[1].value
        if name is not None and name.startswith("_") and not name.startswith("__"):
            found.append((node.lineno, ast.unparse(node)))
    return [f"{line}: {code}" for line, code in sorted(found)]


def test_no_kv_module_but_the_agents_reads_the_agents_private_state():
    """The KV runtime's modules talk to the parts the agent hands them (its registry, route cache, poster,
    request staging, pack state) and to its public attributes, never to ``agent._*``."""
    offenders = {}
    for name, path in modules().items():
        if _inside(name, RUNTIME) and name != AGENT_MODULE:
            if found := private_agent_reads(path.read_text()):
                offenders[name] = found
    assert not offenders, f"KV modules reading an agent's private attributes: {offenders}"


def test_private_agent_reads_are_found():
    src = ("def f(agent, self):\n    agent._track(1)\n    x = self.agent._post_lock\n    self._agent._calls.copy()\n"
           "    getattr(agent, '_requests', None)\n    agent.name, self._lock, agent.__class__, peer._local\n")
    assert [f.split(":")[0] for f in private_agent_reads(src)] == ["2", "3", "4", "5"]

