"""The ``gpuxfer`` command itself: --version, and unknown options reported by the subcommand's own parser."""
from __future__ import annotations

import pytest

from gpuxfer import __version__
from gpuxfer.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"gpuxfer {__version__}"


@pytest.mark.parametrize("argv, usage", [
    (["bench", "kv", "--no-such-flag"], "usage: gpuxfer bench kv"),
    (["bench", "pp", "--no-such-flag"], "usage: gpuxfer bench pp"),
    (["bench", "kernels", "--no-such-flag"], "usage: gpuxfer bench kernels"),
    (["doctor", "--no-such-flag"], "usage: gpuxfer doctor"),
])
def test_an_unknown_flag_shows_the_subcommand_usage(capsys, argv, usage):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith(usage)
    assert "unrecognized arguments: --no-such-flag" in err


@pytest.mark.parametrize("bench", ["kv", "pp", "kernels"])
def test_the_benchmarks_share_one_convention(bench):
    """The same option names for the same concepts in every benchmark."""
    from gpuxfer.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["bench"]
    leaf = next(a for a in sub._actions if a.dest == "subcommand").choices[bench]
    options = {s for a in leaf._actions for s in a.option_strings}
    assert {"--platform", "--timeout", "--out", "--json", "--warmup"} <= options
    ns = leaf.parse_args([])
    assert ns.timeout == "120" and ns.out is None and ns.json is None
    assert leaf.parse_args(["--json"]).json is True and leaf.parse_args(["--json", "x.json"]).json == "x.json"


def test_a_reader_that_leaves_early_gets_no_traceback():
    """`gpuxfer ... | head`: the closed pipe ends the command quietly, with the shell's code for SIGPIPE."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = str(Path(__file__).resolve().parents[1])
    proc = subprocess.Popen([sys.executable, "-m", "gpuxfer.cli", "bench", "kv", "--platform", "host", "--plan-only",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPATH=root))
    proc.stdout.close()             # before the command writes a byte
    err = proc.stderr.read().decode()
    assert proc.wait(120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_a_bad_log_level_variable_is_one_line_not_a_traceback(capsys, monkeypatch):
    """``GPUXFER_LOG_LEVEL`` is read by the command itself, before any subcommand: a bad value is a usage error."""
    monkeypatch.setenv("GPUXFER_LOG_LEVEL", "bogus")
    rc = main(["doctor", "--platform", "host"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("gpuxfer: error: GPUXFER_LOG_LEVEL") and err.count("\n") == 1, err
