"""The README's library snippets run as written (on the host emulation here; ``-m gpu`` on the GPUs)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def snippets() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def _run_snippet(code: str, tmp_path: Path, platform: str) -> subprocess.CompletedProcess:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = dict(os.environ, GPUXFER_PLATFORM=platform, PYTHONPATH=str(ROOT), PYTHONWARNINGS="always")
    return subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)


def test_the_readme_has_the_two_library_snippets():
    found = snippets()
    assert len(found) == 2 and "KVAgent" in found[0] and "connect(" in found[1]


@pytest.mark.parametrize("which", [0, 1], ids=["kv", "pp"])
def test_readme_snippet_runs_on_the_emulation(which, tmp_path):
    r = _run_snippet(snippets()[which], tmp_path, "host")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "leaked" not in r.stderr and "Traceback" not in r.stderr, r.stderr   # nothing left behind
    if which == 1:
        assert r.stdout.strip() == "[1.0, 3.0]"


@pytest.mark.gpu
@pytest.mark.parametrize("which", [0, 1], ids=["kv", "pp"])
def test_readme_snippet_runs_on_cuda(which, tmp_path):
    from _skips import platform_reason
    why = platform_reason("cuda")
    if why:
        pytest.skip(why)
    r = _run_snippet(snippets()[which], tmp_path, "cuda")
    assert r.returncode == 0, r.stdout + r.stderr
