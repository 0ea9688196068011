"""The examples run end to end on the host emulation (on a GPU machine, `-m gpu` runs them on the GPUs)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run_example(script: str, *args: str, platform: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, GPUXFER_PLATFORM=platform, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("script, args, expect", [
    ("pp_two_stage.py", (), "PASS"),
    ("kv_handoff.py", (), "wrong bytes: 0"),
])
def test_example_on_host(script, args, expect):
    r = _run_example(script, *args, platform="host")
    assert r.returncode == 0, r.stdout + r.stderr
    assert expect in r.stdout, r.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("script, args, expect", [
    ("pp_two_stage.py", (), "PASS"),
    ("kv_handoff.py", ("--tokens", "32768"), "wrong bytes: 0"),
])
def test_example_on_cuda(script, args, expect):
    from _skips import platform_reason
    why = platform_reason("cuda")
    if why:
        pytest.skip(why)
    r = _run_example(script, *args, platform="cuda")
    assert r.returncode == 0, r.stdout + r.stderr
    assert expect in r.stdout, r.stdout


@pytest.mark.parametrize("script", ["pp_two_stage.py", "kv_handoff.py"])
def test_example_on_an_unusable_platform_is_one_line(script):
    """A platform that cannot run here is said once, before any process starts: one line, exit 2."""
    from gpuxfer.platforms import unavailable_reason
    why = unavailable_reason("cuda")
    if why is None:
        pytest.skip("CUDA can run here")
    r = _run_example(script, "--platform", "cuda", platform="host")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr == f"{script}: error: platform cuda cannot run here: {why}\n" and r.stdout == ""
    r = _run_example(script, "--platform", "tpu", platform="host")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown platform" in r.stderr, r.stderr
