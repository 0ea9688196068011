"""gpuxfer.config: every GPUXFER_* variable declared once, parsed when read, documented."""

import ast
import pathlib

import pytest

from gpuxfer import config
from gpuxfer.errors import BadInput

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gpuxfer"

# name -> (a good value, what it parses to)
GOOD = {
    "GPUXFER_PLATFORM": ("host", "host"),
    "GPUXFER_HOST_DEVICES": ("4", 4),
    "GPUXFER_WARN_LEAKS": ("0", False),
    "GPUXFER_CUDA_BATCH": ("Loop", "loop"),
    "GPUXFER_ROCM_HOST_FLAG_TIMEOUT_S": ("2.5", 2.5),
    "GPUXFER_ROCM_DEDICATED_QUEUES": ("off", False),
    "GPUXFER_HSA_LIBRARY": ("/opt/rocm/lib/libhsa-runtime64.so.1", "/opt/rocm/lib/libhsa-runtime64.so.1"),
    "GPUXFER_DIRECT_LAUNCH": ("0", False),
    "GPUXFER_PP_TRANSPORT": ("nccl", "nccl"),
    "GPUXFER_PP_TIMEOUT_S": ("30", 30.0),
    "GPUXFER_PP_ON_TIMEOUT": ("EXIT", "exit"),
    "GPUXFER_PP_META_CHANNEL": ("group", "group"),
    "GPUXFER_FLAG_PATH": ("copy", "copy"),
    "GPUXFER_PP_INLINE_BYTES": ("64k", 65536),
    "GPUXFER_PP_STEP_GRAPHS": ("0", False),
    "GPUXFER_PP_FLAG_BATCH": ("1", True),
    "GPUXFER_PP_HOST_GIVE_BACK": ("0", False),
    "GPUXFER_PP_INJECT_FAILURE": ("1:alloc", "1:alloc"),
    "GPUXFER_SDMA_PATH": ("hip", "hip"),
    "GPUXFER_SDMA_RING": ("8", 8),
    "GPUXFER_SDMA_COPIES": ("4", 4),
    "GPUXFER_LOG_LEVEL": ("INFO", "info"),
    "GPUXFER_KV_ON_TIMEOUT": ("exit", "exit"),
    "GPUXFER_KV_TRITON_ORDER": ("plan", "plan"),
    "GPUXFER_KV_COPY": ("descriptors", "descriptors"),
    "GPUXFER_KV_ROUTE": ("nixl", "nixl"),
    "GPUXFER_KV_REMOTE": ("NIXL", "nixl"),
    "GPUXFER_NIXL_PROGRESS_THREAD": ("1", True),
    "GPUXFER_TEST_REQUIRE_NIXL": ("1", True),
    "GPUXFER_TEST_REQUIRE_MOONCAKE": ("1", True),
    "GPUXFER_NIXL_MODULE": ("fake_nixl_net", "fake_nixl_net"),
    "GPUXFER_NIXL_MAX_DESCS": ("10", 10),
    "GPUXFER_KV_NIXL_MAX_DESCRIPTORS": ("64", 64),
    "GPUXFER_NIXL_PACK_STAGE_BYTES": ("4096", 4096),
    "GPUXFER_MOONCAKE_HOST": ("10.0.0.1", "10.0.0.1"),
    "GPUXFER_MOONCAKE_NIC": ("mlx5_{gpu}", "mlx5_{gpu}"),
    "GPUXFER_MORI_MODULE": ("fake_mori", "fake_mori"),
    "GPUXFER_MORI_BACKEND": ("xgmi", "xgmi"),
    "GPUXFER_MORI_HOST": ("10.0.0.2", "10.0.0.2"),
    "GPUXFER_INJECT_FAULT": ("pack:pull", "pack:pull"),
    "GPUXFER_KV_TRACE": ("/tmp/trace", "/tmp/trace"),
    "GPUXFER_VLLM_LEASE_S": ("30", 30.0),
    "GPUXFER_VLLM_HOST": ("10.0.0.3", "10.0.0.3"),
    "GPUXFER_VLLM_PORT": ("5601", 5601),
    "GPUXFER_VLLM_ENGINE": ("copy_engine", "copy_engine"),
    "GPUXFER_VLLM_HANDSHAKE_TIMEOUT_S": ("2.5", 2.5),
    "GPUXFER_VLLM_LOADER": ("process", "process"),
    "GPUXFER_VLLM_LOADER_START_S": ("60", 60.0),
    "GPUXFER_VLLM_TEST_CLOCK_SHIFT_S": ("-1000.5", -1000.5),
    "GPUXFER_REQUIRE_VLLM": ("1", True),
    "GPUXFER_SGLANG_ENGINE": ("copy_engine", "copy_engine"),
    "GPUXFER_SGLANG_UNREQUESTED_ROOMS": ("64", 64),
    "GPUXFER_SGLANG_DECODE_RANKS": ("16", 16),
    "GPUXFER_SGLANG_MAX_FRAME_MB": ("1", 1),
    "GPUXFER_REQUIRE_SGLANG": ("1", True),
}

# name -> (a bad value, part of the message); variables of free text have no bad value
BAD = {
    "GPUXFER_HOST_DEVICES": [("abc", "must be an integer, got 'abc'"), ("0", "must be >= 1, got 0")],
    "GPUXFER_WARN_LEAKS": [("yes", "must be 1 or 0, got 'yes'")],
    "GPUXFER_CUDA_BATCH": [("fast", "got 'fast'")],
    "GPUXFER_ROCM_HOST_FLAG_TIMEOUT_S": [("soon", "must be a number of seconds"), ("inf", "finite"), ("0", "> 0")],
    "GPUXFER_ROCM_DEDICATED_QUEUES": [("2", "must be 1 or 0")],
    "GPUXFER_DIRECT_LAUNCH": [("maybe", "must be 1 or 0")],
    "GPUXFER_PP_TIMEOUT_S": [("x", "must be a number of seconds, got 'x'"), ("nan", "finite"), ("-1", "> 0")],
    "GPUXFER_PP_ON_TIMEOUT": [("abort", "must be raise or exit, got 'abort'")],
    "GPUXFER_PP_META_CHANNEL": [("shm", "must be auto or group, got 'shm'")],
    "GPUXFER_FLAG_PATH": [("bogus", "must be auto, remote or copy, got 'bogus'")],
    "GPUXFER_PP_INLINE_BYTES": [("lots", "cannot read 'lots'")],
    "GPUXFER_PP_STEP_GRAPHS": [("2", "must be 1 or 0")],
    "GPUXFER_PP_FLAG_BATCH": [("2", "must be 1 or 0")],
    "GPUXFER_PP_HOST_GIVE_BACK": [("2", "must be 1 or 0")],
    "GPUXFER_SDMA_PATH": [("dma", "must be hsa or hip")],
    "GPUXFER_SDMA_RING": [("0", "must be in [1, 65536], got 0"), ("many", "must be an integer")],
    "GPUXFER_SDMA_COPIES": [("17", "must be in [1, 16], got 17")],
    "GPUXFER_KV_ON_TIMEOUT": [("never", "must be raise or exit")],
    "GPUXFER_KV_TRITON_ORDER": [("random", "must be peer, local or plan")],
    "GPUXFER_KV_COPY": [("expand", "must be descriptors or blocks, got 'expand'")],
    "GPUXFER_KV_ROUTE": [("rdma", "must be auto, ipc or nixl, got 'rdma'")],
    "GPUXFER_KV_REMOTE": [("ucx", "must be none or nixl, got 'ucx'")],
    "GPUXFER_LOG_LEVEL": [("verbose", "must be debug, info, warning or error")],
    "GPUXFER_NIXL_PROGRESS_THREAD": [("2", "must be 1 or 0")],
    "GPUXFER_TEST_REQUIRE_NIXL": [("yes", "must be 1 or 0")],
    "GPUXFER_TEST_REQUIRE_MOONCAKE": [("yes", "must be 1 or 0")],
    "GPUXFER_NIXL_MAX_DESCS": [("0", "must be >= 1")],
    "GPUXFER_KV_NIXL_MAX_DESCRIPTORS": [("0", "must be in [1, 2147483647]"), ("2147483648", "must be in")],
    "GPUXFER_NIXL_PACK_STAGE_BYTES": [("1G", "must be an integer")],
    "GPUXFER_MORI_BACKEND": [("infiniband", "must be rdma or xgmi, got 'infiniband'")],
    "GPUXFER_VLLM_LEASE_S": [("forever", "must be a number of seconds"), ("0", "> 0")],
    "GPUXFER_VLLM_PORT": [("70000", "must be in [0, 65535], got 70000")],
    "GPUXFER_VLLM_ENGINE": [("pack", "must be auto, triton or copy_engine")],
    "GPUXFER_VLLM_HANDSHAKE_TIMEOUT_S": [("-1", "> 0")],
    "GPUXFER_VLLM_LOADER": [("thread", "must be auto, inline or process")],
    "GPUXFER_VLLM_LOADER_START_S": [("0", "> 0")],
    "GPUXFER_VLLM_TEST_CLOCK_SHIFT_S": [("soon", "must be a number of seconds"), ("inf", "finite"), ("2e9", "within")],
    "GPUXFER_REQUIRE_VLLM": [("please", "must be 1 or 0")],
    "GPUXFER_SGLANG_ENGINE": [("pack", "must be auto, triton or copy_engine")],
    "GPUXFER_SGLANG_UNREQUESTED_ROOMS": [("0", "must be >= 1"), ("many", "must be an integer")],
    "GPUXFER_SGLANG_DECODE_RANKS": [("0", "must be >= 1"), ("all", "must be an integer")],
    "GPUXFER_SGLANG_MAX_FRAME_MB": [("0", "must be in [1, 1048576]"), ("2097152", "must be in [1, 1048576]"),
                                    ("64M", "must be an integer")],
    "GPUXFER_REQUIRE_SGLANG": [("please", "must be 1 or 0")],
}


def test_every_declared_variable_has_a_case():
    assert set(GOOD) == set(config.VARS)
    assert set(BAD) <= set(config.VARS)
    assert {n for n, v in config.VARS.items() if v.parser is not config.TEXT} == set(BAD)


@pytest.mark.parametrize("name", sorted(config.VARS))
def test_default_and_good_value(monkeypatch, name):
    monkeypatch.delenv(name, raising=False)
    assert config.get(name) == config.VARS[name].default
    monkeypatch.setenv(name, "  ")
    assert config.get(name) == config.VARS[name].default      # blank: the default
    raw, want = GOOD[name]
    monkeypatch.setenv(name, raw)
    assert config.get(name) == want


@pytest.mark.parametrize("name,raw,says", [(n, r, s) for n, cases in sorted(BAD.items()) for r, s in cases])
def test_bad_value_names_the_variable(monkeypatch, name, raw, says):
    monkeypatch.setenv(name, raw)
    with pytest.raises(BadInput) as err:
        config.get(name)
    assert str(err.value).startswith(name) and says in str(err.value)


def test_resolve_prefers_the_argument_and_names_the_option(monkeypatch):
    monkeypatch.setenv("GPUXFER_PP_ON_TIMEOUT", "exit")
    assert config.resolve("GPUXFER_PP_ON_TIMEOUT", None) == "exit"
    assert config.resolve("GPUXFER_PP_ON_TIMEOUT", "Raise", option="on_timeout") == "raise"
    with pytest.raises(BadInput, match="^on_timeout must be raise or exit, got 'crash'"):
        config.resolve("GPUXFER_PP_ON_TIMEOUT", "crash", option="on_timeout")
    with pytest.raises(BadInput, match="^inline_bytes: cannot read"):
        config.resolve("GPUXFER_PP_INLINE_BYTES", "lots", option="inline_bytes")


def test_undeclared_name_is_refused():
    with pytest.raises(KeyError, match="GPUXFER_NOPE"):
        config.get("GPUXFER_NOPE")


def test_effective_lists_every_variable(monkeypatch):
    for name in config.VARS:
        monkeypatch.delenv(name, raising=False)
    assert config.effective() == {n: v.default for n, v in config.VARS.items()}


def test_configuration_doc_matches_the_declarations():
    doc = (ROOT / "docs" / "CONFIGURATION.md").read_text()
    assert doc == config.document(), "regenerate it: python -m gpuxfer.config > docs/CONFIGURATION.md"


# ---------------------------------------------------------------------------- the rule stays true


def _gpuxfer_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level names bound to a ``"GPUXFER_..."`` string."""
    out = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str) and node.value.value.startswith("GPUXFER_")):
            out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


def _is_environ(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ"


def _env_reads(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, variable)`` of every read of a GPUXFER_* variable from ``os.environ`` / ``os.getenv``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    consts = _gpuxfer_constants(tree)

    def name_of(arg) -> str | None:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
        if isinstance(arg, ast.Name):
            return consts.get(arg.id)
        return None

    reads = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and (
                    (f.attr == "get" and _is_environ(f.value)) or f.attr == "getenv"):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops) \
                and any(_is_environ(c) for c in node.comparators):
            key = node.left
        name = name_of(key) if key is not None else None
        if name and name.startswith("GPUXFER_"):
            reads.append((node.lineno, name))
    return reads


def test_no_module_but_config_reads_a_gpuxfer_variable():
    offenders = [f"{p.relative_to(ROOT)}:{line}: {name}"
                 for p in sorted(PACKAGE.rglob("*.py")) if p.name != "config.py" or p.parent != PACKAGE
                 for line, name in _env_reads(p)]
    assert offenders == [], "read these through gpuxfer.config: " + ", ".join(offenders)


def test_the_scan_sees_direct_reads(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('import os\nENV = "GPUXFER_X"\na = os.environ.get(ENV)\nb = os.getenv("GPUXFER_Y")\n'
                   'c = os.environ["GPUXFER_Z"]\nd = "GPUXFER_W" in os.environ\nos.environ["GPUXFER_V"] = "1"\n')
    assert _env_reads(src) == [(3, "GPUXFER_X"), (4, "GPUXFER_Y"), (5, "GPUXFER_Z"), (6, "GPUXFER_W")]


def test_every_gpuxfer_constant_in_the_package_is_declared():
    names = set()
    for p in PACKAGE.rglob("*.py"):
        names |= set(_gpuxfer_constants(ast.parse(p.read_text())).values())
    assert names - set(config.VARS) == set()


def test_report_marks_set_and_bad_variables(monkeypatch):
    for name in config.VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPUXFER_PP_TIMEOUT_S", "30")
    monkeypatch.setenv("GPUXFER_SDMA_RING", "0")
    rep = config.report()
    assert set(rep) == set(config.VARS)
    assert rep["GPUXFER_PP_TIMEOUT_S"] == {"value": 30.0, "set": True, "error": None}
    assert rep["GPUXFER_HOST_DEVICES"] == {"value": 2, "set": False, "error": None}
    assert rep["GPUXFER_SDMA_RING"]["set"] and "GPUXFER_SDMA_RING must be in [1, 65536]" in rep["GPUXFER_SDMA_RING"]["error"]


def test_no_module_reads_the_environment_outside_config():
    """Reads go through config.get (declared, parsed, documented); writes for child processes are allowed."""
    import re
    read = re.compile(r"os\.environ\.get\(|os\.getenv\(|os\.environ\[[^\]]+\](?!\s*=[^=])|\bin os\.environ\b")
    offenders = []
    for path in sorted((ROOT / "gpuxfer").rglob("*.py")):
        if path.name == "config.py" and path.parent.name == "gpuxfer":
            continue
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if read.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_torchrun_is_read_once_and_checked():
    from gpuxfer.errors import BadInput
    env = {"RANK": "1", "WORLD_SIZE": "2"}
    import os
    old = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    try:
        for k in old:
            os.environ.pop(k, None)
        assert config.torchrun() is None
        os.environ.update(env)
        assert config.torchrun() == (1, 2, 1)
        os.environ["LOCAL_RANK"] = "0"
        assert config.torchrun() == (1, 2, 0)
        os.environ["WORLD_SIZE"] = "two"
        with pytest.raises(BadInput, match="WORLD_SIZE"):
            config.torchrun()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
