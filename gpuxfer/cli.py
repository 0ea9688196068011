"""The ``gpuxfer`` command: ``doctor``, ``bench kv``, ``bench pp``, ``bench kernels``.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int`` (the exit code); this file only wires them up. The modules
are imported when the parser is built (not when gpuxfer is imported), and none
of them touches a GPU before ``run``.
"""
from __future__ import annotations

import argparse
import importlib
import os
import logging
import sys

from . import __version__, config
from .errors import GpuxferError

# (command path, module, one-line help)
COMMANDS = [
    (("doctor",), "gpuxfer.doctor", "report the platform, devices, links and which backends/engines work here"),
    (("bench", "kv"), "gpuxfer.bench.kv.cli", "KV-cache hand-off benchmark: engines vs the bulk copy ceiling, every byte verified"),
    (("bench", "pp"), "gpuxfer.bench.pp.cli", "stage hand-off benchmark: copy engines vs NCCL, step time and SM contention"),
    (("bench", "kernels"), "gpuxfer.bench.kernels", "Triton copy kernels vs the copy-engine and local HBM ceilings"),
]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default, unless its help already says it or there is none to show."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuxfer", description="GPU-to-GPU transfers for LLM inference, in pure Python.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log at INFO level, the benchmarks' ranks included (GPUXFER_LOG_LEVEL=INFO)")
    parser.add_argument("--version", action="version", version=f"gpuxfer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, module, help_ in COMMANDS:
        if len(path) == 1:
            p = sub.add_parser(path[0], help=help_, description=help_)
        else:
            if path[0] not in groups:
                g = sub.add_parser(path[0], help="benchmarks: " + ", ".join(c[0][1] for c in COMMANDS if c[0][0] == path[0]))
                groups[path[0]] = g.add_subparsers(dest="subcommand", metavar="BENCH", required=True)
            p = groups[path[0]].add_parser(path[1], help=help_, description=help_,
                                           formatter_class=_HelpFormatter)
        p.set_defaults(_module=module, _parser=p)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:     # said by the subcommand's parser, with its usage, not the top level's
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.verbose:                # the benchmarks' spawned ranks read it too
        os.environ["GPUXFER_LOG_LEVEL"] = "info"
    try:
        level = config.get("GPUXFER_LOG_LEVEL")
    except GpuxferError as exc:     # a bad variable, as a bad option: one line, the usage error's code
        print(f"gpuxfer: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except BrokenPipeError:
        # the reader left (`| head`): stop quietly with the shell's code for SIGPIPE, and send what is still
        # buffered for stdout nowhere, so that the interpreter's exit does not fail on it again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13


if __name__ == "__main__":
    sys.exit(main())
