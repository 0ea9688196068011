"""The benchmarks' one reporter, in the style of nccl-tests.

Every ``gpuxfer bench`` command prints the same shape:

* a ``#`` preamble: the command, versions, devices, link, every parameter, what
  each number times (``versions_line`` and ``link_text`` write the shared lines);
* a :class:`Table`: a header row and a units row (``#`` lines), then one line per
  measured row as it completes, with a wrong-bytes column;
* a footer (:meth:`Verdict.lines`): ``# Out of bounds values : N OK|FAILED`` (every
  byte checked) and ``# Result: PASS|FAIL...``;
* a JSON mirror of the same content (:func:`dumps`: strict JSON, keys carrying
  their unit: ``_bytes``, ``_us``, ``_ms``, ``_gbps``, ``_pct``);
* the exit code of the verdict (:attr:`Verdict.exit_code`): 0 only on a pass.
"""
from __future__ import annotations

import textwrap

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

# ----------------------------------------------------------------------------- cell formats


def nearest_rank(xs, q: float):
    """The ``q`` quantile of ``xs`` by nearest rank: the ``ceil(q * n)``-th smallest of the ``n`` samples (a
    sample, not an interpolation; the p90 of 10 is the 9th, of 3 the largest); None when empty."""
    xs = sorted(xs)
    if not xs:
        return None
    rank = math.ceil(q * len(xs) - 1e-9)           # q * n within rounding of an integer is that integer
    return xs[min(len(xs) - 1, max(0, rank - 1))]


def ceiling_excess(rate, ceiling, fastest=None, *, judged: bool = True) -> tuple[bool | None, str] | None:
    """A rate (GB/s) against its ceiling's rate of the same statistic: None when it is at most the ceiling
    (or either is unknown); else ``(explained, note)``. Explained when ``rate`` is at most ``fastest``, the
    ceiling's own fastest sample: the two differ by the ceiling's spread. A rate above every sample of its
    ceiling is not explained (the ceiling under-measures what the link moves): the run fails on it.
    ``judged=False`` (the host emulation, whose times measure a shared CPU): ``explained`` is None, noted."""
    if not rate or not ceiling or rate <= ceiling:
        return None
    pct = 100.0 * rate / ceiling
    if not judged:
        return None, f"{pct:.1f}% of its ceiling (EMULATION: host times, not judged)"
    if fastest is not None and rate <= fastest:
        return True, f"{pct:.1f}% of its ceiling, within the ceiling's spread (its fastest sample {fastest:.4g} GB/s)"
    return False, (f"{pct:.1f}% of its ceiling, above the ceiling's fastest sample"
                   + (f" ({fastest:.4g} GB/s)" if fastest is not None else "") + ": the ceiling is not one")


def text(v) -> str:
    return "-" if v is None else str(v)


def integer(v) -> str:
    return "-" if v is None else str(int(v))


def fixed(digits: int) -> Callable[[Any], str]:
    """``v`` with ``digits`` decimals; ``-`` for None or NaN."""
    def fmt(v) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        return f"{v:.{digits}f}"
    return fmt


def rate(v) -> str:
    """Up to 4 significant digits, at least 2 below 1 (an emulated 0.00041 GB/s is not printed as 0.000),
    never scientific above 1e-6."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if v >= 100:
        return f"{v:.1f}"
    if v >= 10:
        return f"{v:.2f}"
    if v >= 0.1 or v == 0:
        return f"{v:.3f}"
    if v < 1e-6:
        return f"{v:.1e}"
    return f"{v:.{1 - math.floor(math.log10(v))}f}"


def percent(v) -> str:
    """A percentage with one decimal, or 2 significant digits below 1 % (``0.042``); ``-`` for None."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.1f}" if v >= 1 or v == 0 else rate(v)


# ----------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Column:
    """One column: the row key it shows, its header, its unit (the units row), width and format."""

    key: str
    header: str
    unit: str
    width: int
    fmt: Callable[[Any], str] = text
    left: bool = False


class Table:
    """Fixed-width columns: ``header_lines()`` (names, then units, as ``#`` lines) and ``line(row)``.

    A row line starts with ``prefix``; the header lines put ``#`` in its first character, so
    the columns line up under their headers.
    """

    def __init__(self, columns: Sequence[Column], *, prefix: str = "  "):
        self.columns = list(columns)
        self.prefix = prefix

    def cells(self, values: Iterable[str]) -> str:
        return " ".join(v.ljust(c.width) if c.left else v.rjust(c.width) for c, v in zip(self.columns, values))

    def _comment(self, values: Iterable[str]) -> str:
        return "#" + (self.prefix + self.cells(values))[1:]

    def header_lines(self) -> list[str]:
        return [self._comment(c.header for c in self.columns), self._comment(c.unit for c in self.columns)]

    def line(self, row: Mapping[str, Any]) -> str:
        return self.prefix + self.cells(c.fmt(row.get(c.key)) for c in self.columns)


# ----------------------------------------------------------------------------- preamble pieces


def versions_line(versions: Mapping[str, Any]) -> str | None:
    """``# versions: torch 2.11, triton 3.6, ...`` (None when there is nothing to say)."""
    if not versions:
        return None
    return "# versions: " + ", ".join(f"{k} {v}" for k, v in versions.items())


def link_text(link: Mapping[str, Any], *, arrow: str = "->", detail: str = "({})") -> str:
    """``device 0 -> 1: nvlink (NV18)``, the detail in the ``detail`` format when there is one."""
    more = link.get("detail")
    return f"{link.get('src')} {arrow} {link.get('dst')}: {link.get('kind')}{' ' + detail.format(more) if more else ''}"


# ----------------------------------------------------------------------------- verdict, footer, exit code


@dataclass
class Verdict:
    """The outcome of a run: the wrong bytes every check found, and every other reason it failed."""

    wrong_bytes: int = 0
    reasons: list[str] = field(default_factory=list)
    emulation: bool = False

    @property
    def ok(self) -> bool:
        return self.wrong_bytes == 0 and not self.reasons

    @property
    def result(self) -> str:
        """``PASS``, or ``FAIL: <the first reason>`` (``FAIL: wrong bytes`` when only bytes were wrong)."""
        if self.ok:
            return "PASS"
        first = (self.reasons[0].strip().splitlines() or [""])[0] if self.reasons else "wrong bytes"
        return f"FAIL: {first}"

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def lines(self) -> list[str]:
        return footer_lines(self.wrong_bytes, self.result, emulation=self.emulation)


def wrap_comments(lines: list[str], width: int = 120) -> list[str]:
    """The report's prose comments (``# `` then a word) wrapped at ``width``, continued as ``#   ...``;
    table rows and their headers (``#`` then spaces, or no ``#``) as they are; a word longer than a line
    (a path) is never split."""
    out = []
    for ln in lines:
        if len(ln) <= width or not ln.startswith("# ") or ln[2:3].isspace():
            out.append(ln)
            continue
        out.extend(textwrap.wrap(ln[2:], width - 4, initial_indent="# ", subsequent_indent="#   ",
                                 break_on_hyphens=False, break_long_words=False))
    return out


def footer_lines(wrong_bytes: int, result: str, *, emulation: bool = False) -> list[str]:
    """nccl-tests' closing lines: the wrong-byte count with its verdict, then the result."""
    return [f"# Out of bounds values : {wrong_bytes} {'OK' if wrong_bytes == 0 else 'FAILED'}",
            f"# Result: {result}{' (EMULATION)' if emulation else ''}"]


# ----------------------------------------------------------------------------- JSON


def _plain(o):
    """``o`` with numpy scalars and arrays as Python values and non-finite floats as None."""
    if isinstance(o, dict):
        return {k: _plain(v) for k, v in o.items()}
    if isinstance(o, (list, tuple, set)):
        return [_plain(v) for v in o]
    if isinstance(o, np.ndarray):
        return _plain(o.tolist())
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, (float, np.floating)):
        return float(o) if math.isfinite(o) else None
    return o


def dumps(doc: Mapping[str, Any], *, indent: int = 1) -> str:
    """``doc`` as strict JSON (no NaN nor Infinity: an unknown number is null); other objects as their text."""
    return json.dumps(_plain(doc), indent=indent, default=str, allow_nan=False)
