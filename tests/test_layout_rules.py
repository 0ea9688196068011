"""Rules on how the tree is laid out (the test files; docs/ARCHITECTURE.md against the code), checked so they
stay true."""
import pathlib
import re

TESTS = pathlib.Path(__file__).resolve().parent
MAX_TEST_FILE_LINES = 1000


def test_no_test_file_is_over_the_line_limit():
    """A test module longer than this is split by topic (shared fixtures in its folder's conftest.py)."""
    long = {str(p.relative_to(TESTS)): n for p in sorted(TESTS.rglob("test_*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_TEST_FILE_LINES}
    assert not long, f"test files over {MAX_TEST_FILE_LINES} lines: {long}"


ROOT = TESTS.parent
MAX_DOC_LINES = 1000


def test_no_document_repeats_a_paragraph_or_runs_long():
    """The docs are read whole: none is over the line limit, and none holds the same paragraph twice (what a
    botched scripted edit leaves)."""
    bad = {}
    for p in sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]):
        text = p.read_text()
        paras = [b.strip() for b in text.split("\n\n") if len(b.strip()) > 200 and not b.strip().startswith("```")]
        repeated = {b[:60] for b in paras if paras.count(b) > 1}
        if len(text.splitlines()) > MAX_DOC_LINES or repeated:
            bad[str(p.relative_to(ROOT))] = (len(text.splitlines()), sorted(repeated)[:2])
    assert not bad, f"documents over {MAX_DOC_LINES} lines or with a repeated paragraph: {bad}"


ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
#: a package paragraph of docs/ARCHITECTURE.md: **`kv/`** (imports `kernels`, `platforms`, ...)
_PARAGRAPH = re.compile(r"^\*\*`(?P<unit>[\w]+)(?:/|\.py)`\*\* \(imports (?P<imports>[^)]*)\)", re.M)


def _unit(module: str) -> str | None:
    """The package or top-level module of ``gpuxfer`` that ``module`` belongs to (None: the root package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_module_the_architecture_names_exists():
    """Every ``gpuxfer/...`` path, ``gpuxfer.x.y`` name and ``name.py`` file docs/ARCHITECTURE.md names is in
    the tree (a dotted name may end in an attribute its module defines)."""
    text = ARCHITECTURE.read_text()
    files = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py")}
    missing = []
    for path in set(re.findall(r"\bgpuxfer/[\w/]*\w(?:\.py)?", text)):
        if not (ROOT / path).exists():
            missing.append(path)
    for name in set(re.findall(r"`([\w/]+\.py)`", text)):
        if not any(f == name or f.endswith("/" + name) for f in files):
            missing.append(name)
    for dotted in set(re.findall(r"\bgpuxfer(?:\.\w+)+", text)):
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            base = ROOT.joinpath(*parts[:n])
            source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
            if source.exists():
                break
        rest = parts[n:]
        if n < 2 or len(rest) > 1 or (rest and not re.search(
                rf"^(?:def|class) {rest[0]}\b|^{rest[0]}\b.*=|import .*\b{rest[0]}\b", source.read_text(), re.M)):
            missing.append(dotted)
    assert not missing, f"docs/ARCHITECTURE.md names what is not in the tree: {sorted(missing)}"


def test_the_architecture_lists_each_packages_imports():
    """Each package paragraph of docs/ARCHITECTURE.md names exactly the packages and top-level modules its
    modules import (any import statement: tests/test_import_graph.py's reading); every package has one."""
    from test_import_graph import graph
    actual: dict[str, set[str]] = {}
    for module, targets in graph().items():
        unit = _unit(module)
        if unit is None or unit == "__main__":
            continue
        actual.setdefault(unit, set()).update(u for t in targets if (u := _unit(t)) not in (None, unit))
    stated = {m["unit"]: set(re.findall(r"`(\w+)`", m["imports"])) for m in _PARAGRAPH.finditer(
        ARCHITECTURE.read_text())}
    assert stated.keys() == actual.keys(), f"paragraphs missing: {sorted(actual.keys() - stated.keys())}, " \
                                           f"for no package: {sorted(stated.keys() - actual.keys())}"
    wrong = {u: {"stated": sorted(stated[u]), "imports": sorted(actual[u])} for u in actual if stated[u] != actual[u]}
    assert not wrong, f"docs/ARCHITECTURE.md's import lists differ from the code: {wrong}"
