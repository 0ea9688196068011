"""Reporting for ``gpuxfer bench kv``: the live table, the summary, the JSON artifact, the plots.

The output follows nccl-tests: a ``#`` preamble (versions, devices, platform, every
parameter), fixed columns with a units row, one line per measured row as it
completes, ``#`` comment lines for shed grid points, a summary table, and a
pass/fail footer. The same content is written as one JSON document whose keys
carry their unit (``_bytes``, ``_ms``, ``_gbps``, ``_pct``, ``_us``).

Units, defined once (see also docs/kv_bench.md):

* **GB/s** is decimal: payload bytes of the burst / burst time / 1e9. The payload
  is the sum of the descriptor sizes of every request of the burst; each byte is
  counted once (not read + written).
* **burst time** is host wall clock from the first post to the return of the last
  wait, on the process that initiates the transfer; the preparation of the burst
  (``prep_ms``) is measured apart and never inside it.
* **p50 / min / max** are taken over the timed trials (one burst each) after the
  warm-up bursts; GB/s min/max come from the max/min burst times.
* **% of ceiling** divides a row's p50 GB/s by the p50 GB/s of the ``bulk`` row of
  the same point, batch and direction (one descriptor of the same total bytes on
  the copy engines).

Timing code returns samples (seconds); their statistics come from :mod:`gpuxfer.bench.timing`, and the
table, footer and JSON machinery from :mod:`gpuxfer.bench.report`, shared by every bench.
"""
from __future__ import annotations

import datetime as _dt
import io
import os
import sys
from typing import Any, Sequence

from ..cpus import AUTO, describe
from ..report import (Column, Table, Verdict, ceiling_excess, integer, link_text, percent, rate, text,
                      versions_line, wrap_comments)
from ..report import dumps as _dumps
from ..timing import gbps, sample_stats

__all__ = ["SCHEMA", "GBPS_DEFINITION", "sample_stats", "gbps", "finish_row", "apply_ceiling", "COLUMNS", "TABLE",
           "header_lines", "format_row", "format_shed", "preamble_lines", "summary", "summary_lines", "outcome",
           "footer_lines", "build_document", "dumps", "write_json_atomic", "plot", "Reporter"]

SCHEMA = "gpuxfer.kv-bench/1"
GBPS_DEFINITION = ("GB/s = payload bytes of the burst (sum of descriptor sizes of every request, each byte "
                   "counted once) / burst time / 1e9; burst time = host wall clock from the first post to the "
                   "last wait on the initiating process, p50 over the timed trials; prep excluded")

# ----------------------------------------------------------------------------- statistics


def finish_row(row: dict[str, Any], samples_s: Sequence[float]) -> dict[str, Any]:
    """Add the timing statistics and derived bandwidths of ``samples_s`` to ``row`` (in place; returned)."""
    st = sample_stats(samples_s)
    nbytes, ndesc = row["burst_bytes"], row["descriptors"]
    row["trials"] = st["n"]
    row["samples_ms"] = [round(s * 1e3, 6) for s in samples_s]
    for k in ("p50", "p10", "p90", "min", "max", "mean"):
        row[f"burst_{k}_ms"] = st[f"{k}_ms"]
    row["p50_gbps"] = gbps(nbytes, st["p50_ms"])
    row["min_gbps"] = gbps(nbytes, st["max_ms"])     # slowest burst
    row["max_gbps"] = gbps(nbytes, st["min_ms"])     # fastest burst
    row["per_descriptor_p50_us"] = (st["p50_ms"] * 1e3 / ndesc) if st["p50_ms"] is not None and ndesc else None
    return row


def apply_ceiling(row: dict[str, Any], ceiling_gbps: float | None, fastest_gbps: float | None = None, *,
                  judged: bool = True) -> None:
    """``row``'s share of its ceiling row's p50 GB/s; ``fastest_gbps``, the ceiling row's fastest burst, says
    whether a row above the ceiling is within its spread (``above_ceiling`` and ``above_ceiling_explained``:
    a row above every burst of its ceiling fails the run; on the host emulation, ``judged=False``, it is
    noted, not judged)."""
    row["ceiling_gbps"] = ceiling_gbps
    if ceiling_gbps and row.get("p50_gbps") is not None:
        row["of_ceiling_pct"] = 100.0 * row["p50_gbps"] / ceiling_gbps
    else:
        row["of_ceiling_pct"] = None
    excess = ceiling_excess(row.get("p50_gbps"), ceiling_gbps, fastest_gbps, judged=judged)
    row["above_ceiling"] = None if excess is None else excess[1]
    row["above_ceiling_explained"] = None if excess is None else excess[0]


# ----------------------------------------------------------------------------- the table


def _wrong(v) -> str:
    return "N/A" if v is None else str(int(v))


COLUMNS: list[Column] = [
    Column("workload", "workload", "", 9, text, left=True),
    Column("page_tokens", "page", "tokens", 6, integer),
    Column("isl_tokens", "ISL", "tokens", 7, integer),
    Column("batch", "batch", "reqs", 5, integer),
    Column("engine", "engine", "", 17, text, left=True),
    Column("direction", "dir", "", 4, text, left=True),
    Column("burst_bytes", "bytes", "B", 12, integer),
    Column("descriptors", "descs", "#", 9, integer),
    Column("burst_p50_ms", "time", "ms", 9, rate),
    Column("p50_gbps", "GB/s", "p50", 7, rate),
    Column("min_gbps", "min", "GB/s", 7, rate),
    Column("max_gbps", "max", "GB/s", 7, rate),
    Column("of_ceiling_pct", "ceil", "%", 6, percent),
    Column("per_descriptor_p50_us", "t/desc", "us", 8, rate),
    Column("prep_ms", "prep", "ms", 8, rate),
    Column("post_p50_us", "post", "us/req", 8, rate),
    Column("setup_us", "setup", "us/req", 8, rate),
    Column("wrong_bytes", "#wrong", "B", 8, _wrong),
]


TABLE = Table(COLUMNS)


def header_lines() -> list[str]:
    return TABLE.header_lines()


def format_row(row: dict[str, Any]) -> str:
    line = TABLE.line(row)
    if row.get("error"):
        line += f"  ERROR: {row['error']}"
    elif row.get("valid") is False:
        line += "  INVALID"
    if row.get("above_ceiling"):
        line += f"  ABOVE CEILING: {row['above_ceiling']}"
    return line


def format_shed(item: dict[str, Any]) -> str:
    what = " ".join(f"{k}={item[k]}" for k in ("workload", "page_tokens", "isl_tokens", "batch", "engine",
                                               "direction") if item.get(k) is not None)
    return f"# shed: {what}: {item.get('reason', '')}"


# ----------------------------------------------------------------------------- preamble, summary, footer


def preamble_lines(env: dict[str, Any], params: dict[str, Any]) -> list[str]:
    lines = [f"# gpuxfer bench kv -- {env.get('platform_label', '?')}"]
    if env.get("is_emulation"):
        lines.append("# EMULATION: no GPU is used; the numbers measure the host, not a transfer engine")
    if versions_line(env.get("versions", {})):
        lines.append(versions_line(env["versions"]))
    if env.get("hostname"):
        lines.append(f"# host: {env['hostname']}  pid(s): {env.get('pids', '')}  launcher: {env.get('launcher', '')}")
    for d in env.get("devices", []):
        info = d.get("info") or {}
        mem = info.get("total_bytes")
        mem_s = f"{mem / 1e9:.1f} GB" if mem else "?"
        lines.append(f"#  rank {d['rank']} ({d['role']}) pid {d.get('pid', '?')} device {info.get('index', '?')}: "
                     f"{info.get('name', '?')} [{info.get('arch', '?')}] {mem_s}, {info.get('sm_count', '?')} SMs, "
                     f"{info.get('copy_engines', '?')} copy engines, bus {info.get('pci_bus_id') or '-'}")
    if "cpus_by_rank" in env:
        lines.extend(cpu_lines(env, params.get("cpus")))
    link = env.get("link")
    if link:
        lines.append(f"# link: device {link_text(link)}, peer access {link.get('peer_access')}")
    eng = env.get("engines")
    if eng:
        lines.append(engines_line(eng))
    lines.append("# parameters: " + " ".join(f"{k}={_param(v)}" for k, v in params.items() if k != "grid"))
    grid = params.get("grid")
    if grid:
        lines.append(f"# pools: {grid.get('max_pool_per_rank_bytes', 0):,} B per rank; budget "
                     f"{grid.get('pool_budget_bytes', 0):,} B per rank (asked {grid.get('asked_pool_budget_bytes', 0):,}), "
                     f"{grid.get('desc_budget_descriptors', 0):,} descriptors per burst, "
                     f"{grid.get('pools_per_device', 1)} pool(s) per device")
    lines.append("# " + GBPS_DEFINITION)
    lines.append("#")
    return lines


#: the longest reason the ``# engines:`` line prints (the JSON's environment has every reason whole)
REASON_CHARS = 100


def engines_line(engines: dict[str, str | None]) -> str:
    """``# engines: bulk, triton ok; nixl, nixl-bulk unusable (NIXL is not installed ...)``: the usable ones,
    then the unusable ones grouped by reason, each reason once and cut at :data:`REASON_CHARS`."""
    ok = [k for k, v in engines.items() if v is None]
    by_reason: dict[str, list[str]] = {}
    for k, v in engines.items():
        if v is not None:
            by_reason.setdefault(v, []).append(k)
    parts = [", ".join(ok) + " ok"] if ok else []
    for why, names in by_reason.items():
        short = why if len(why) <= REASON_CHARS else why[:REASON_CHARS].rstrip() + "..."
        parts.append(f"{', '.join(names)} unusable ({short})")
    return "# engines: " + "; ".join(parts)


def cpu_lines(env: dict[str, Any], asked: str | None) -> list[str]:
    """``# CPUs:`` each rank's CPUs and how they were chosen (``--cpus``); with ``auto``, the core each picked
    and its yardstick beside its other cores' (where ``auto`` could not pin, it says why)."""
    spec, picks = env.get("cpus_spec"), env.get("cpu_pick_by_rank") or []
    placed = spec if spec != AUTO or (picks and all(picks)) else None
    line = f"# CPUs: {describe(env['cpus_by_rank'], placed)}"
    if asked == AUTO and placed is None:
        line += ("; --cpus auto needs a physical core per rank" if spec is None else
                 "; --cpus auto could not pin every rank")
    lines = [line]
    if placed == AUTO:
        lines.append("# CPUs picked (a pure-Python yardstick, us; the same loop on the rank's other cores; picked "
                     "again before each row): " + ", ".join(
                         f"rank {r} CPU {p['cpu']} {p['python_us']:.0f} ({min(p['candidates_python_us'].values()):.0f}"
                         f"-{max(p['candidates_python_us'].values()):.0f})" for r, p in enumerate(picks)))
    return lines


def _param(v) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    if isinstance(v, dict):
        return ",".join(f"{k}:{x}" for k, x in v.items())
    return str(v)


def summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (workload, ISL, page, direction, engine): GB/s at batch 1 and at the largest measured batch;
    the suite's bulk rows (one descriptor) apart, ``kind`` ``bulk``, after the paged ones."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("p50_gbps") is None:
            continue
        kind = "bulk" if r.get("kind") == "bulk" else "paged"
        key = (kind, r["workload"], r["isl_tokens"], r["page_tokens"], r["direction"], r["engine"])
        groups.setdefault(key, []).append(r)
    out = []
    for (kind, wl, isl, page, direction, engine), rs in sorted(groups.items(), key=lambda kv: kv[0][0] == "bulk"):
        rs = sorted(rs, key=lambda r: r["batch"])
        lo, hi = rs[0], rs[-1]
        out.append({
            "kind": kind, "workload": wl, "isl_tokens": isl, "page_tokens": page, "direction": direction,
            "engine": engine,
            "batch_min": lo["batch"], "batch_min_gbps": lo["p50_gbps"], "batch_min_of_ceiling_pct": lo.get("of_ceiling_pct"),
            "batch_max": hi["batch"], "batch_max_gbps": hi["p50_gbps"], "batch_max_of_ceiling_pct": hi.get("of_ceiling_pct"),
            "worst_of_ceiling_pct": min((r["of_ceiling_pct"] for r in rs if r.get("of_ceiling_pct") is not None),
                                        default=None),
            "batch_min_per_descriptor_us": lo.get("per_descriptor_p50_us"),
            "all_valid": all(r.get("valid") for r in rs),
        })
    return out


def summary_lines(summ: Sequence[dict[str, Any]]) -> list[str]:
    if not summ:
        return ["# summary: no row was measured"]
    lines = ["#", "# summary: GB/s p50 (% of the bulk ceiling) at the smallest and the largest batch measured;",
             "# worst % over every batch; t/desc = burst time per descriptor at the smallest batch;",
             "# page 'bulk': the suite's one-descriptor rows",
             f"# {'workload':<9} {'ISL':>7} {'page':>5} {'dir':<4} {'engine':<11} {'batch':>5} {'GB/s':>7} {'(%)':>7}"
             f" {'batch':>5} {'GB/s':>7} {'(%)':>7} {'worst %':>7} {'t/desc us':>9}  valid"]
    for s in summ:
        def pct(v):
            return f"({percent(v)})"
        lines.append(
            f"# {s['workload']:<9} {s['isl_tokens']:>7} "
            f"{'bulk' if s.get('kind') == 'bulk' else s['page_tokens']:>5} {s['direction']:<4} {s['engine']:<11} "
            f"{s['batch_min']:>5} {rate(s['batch_min_gbps']):>7} {pct(s['batch_min_of_ceiling_pct']):>7} "
            f"{s['batch_max']:>5} {rate(s['batch_max_gbps']):>7} {pct(s['batch_max_of_ceiling_pct']):>7} "
            f"{percent(s['worst_of_ceiling_pct']):>7} {rate(s['batch_min_per_descriptor_us']):>9}  "
            f"{'yes' if s['all_valid'] else 'NO'}")
    return lines


#: the exit code of a run stopped by Ctrl-C (128 + SIGINT, as a shell reports it)
EXIT_INTERRUPTED = 130


def _after_interrupt(text: str) -> bool:
    """An error that only says how a rank went down after Ctrl-C (its KeyboardInterrupt, its kill)."""
    return ("KeyboardInterrupt" in text or " exited with code " in text or " was killed" in text
            or " exited without a result" in text or "did not complete" in text)


def outcome(rows: Sequence[dict[str, Any]], errors: Sequence[str], *, expected_rows: int | None = None,
            complete: bool = True) -> dict[str, Any]:
    from ...spawn import INTERRUPTED
    invalid = [r for r in rows if r.get("valid") is False]
    failed = [r for r in rows if r.get("error")]
    interrupted = INTERRUPTED in errors
    reasons = list(errors)
    if interrupted:     # first, and without the ranks' own words about going down
        done = f"{len(rows)} of {expected_rows}" if expected_rows else str(len(rows))
        reasons = [f"interrupted (Ctrl-C) after {done} rows; the finished rows are kept"] + [
            e for e in errors if e != INTERRUPTED and not _after_interrupt(e)]
    for r in failed:
        reasons.append(f"{_row_id(r)}: {r['error']}")
    for r in invalid:
        if r.get("error"):
            continue
        sampled_failed = (r.get("suite_verify") or {}).get("passed") is False
        if sampled_failed:
            reasons.append(f"{_row_id(r)}: the suite's sampled verification failed: {r['suite_verify']['detail']}")
        if r.get("wrong_bytes") or not sampled_failed:
            reasons.append(f"{_row_id(r)}: {r.get('wrong_bytes')} wrong bytes (first wrong descriptor "
                           f"{r.get('first_wrong_descriptor')})")
    for r in rows:
        if r.get("above_ceiling_explained") is False:
            reasons.append(f"{_row_id(r)}: {r['above_ceiling']}")
    if not complete and not interrupted:
        reasons.append("the run did not complete")
    elif complete and not rows and not reasons:
        reasons.append("no row was measured: every row was shed (the # shed lines say why)")
    elif complete and expected_rows is not None and len(rows) != expected_rows:
        reasons.append(f"{len(rows)} rows measured of the {expected_rows} the run set out to measure")
    ok = not reasons
    status = "interrupted" if interrupted else "pass" if ok else "fail"
    return {"status": status, "rows": len(rows), "rows_valid": sum(1 for r in rows if r.get("valid")),
            "rows_invalid": len(invalid), "rows_failed": len(failed), "rows_expected": expected_rows,
            "complete": complete, "reasons": reasons}


def _row_id(r: dict[str, Any]) -> str:
    return (f"{r.get('engine')} {r.get('direction')} page {r.get('page_tokens')} ISL {r.get('isl_tokens')} "
            f"batch {r.get('batch')}")


def footer_lines(out: dict[str, Any], artifacts: dict[str, Any], *, wrong_bytes: int = 0,
                 emulation: bool = False) -> list[str]:
    """The artifacts, the row counts, the verdict with its reasons, then the shared closing lines."""
    lines = ["#"]
    if artifacts.get("json"):
        lines.append(f"# json: {artifacts['json']}")
    for p in artifacts.get("suite_json", []):
        lines.append(f"# suite json: {p}")
    for p in artifacts.get("plots", []):
        lines.append(f"# plot: {p}")
    lines.append(f"# rows: {out['rows']} measured: {out['rows_valid']} verified correct, {out['rows_invalid']} "
                 f"invalid (wrong bytes or failed), {out['rows_failed']} failed to run"
                 + (f"; {out['rows_expected']} expected" if out.get("rows_expected") not in (None, out["rows"]) else ""))
    if out["status"] == "pass":
        lines.append("# PASS: every byte of every request verified")
    else:
        lines.append(f"# {'INTERRUPTED' if out['status'] == 'interrupted' else 'FAIL'}: "
                     f"{len(out['reasons'])} problem(s)")
        for r in out["reasons"][:20]:
            lines.append(f"#   {r}")
        if len(out["reasons"]) > 20:
            lines.append(f"#   ... and {len(out['reasons']) - 20} more (see the JSON artifact)")
    verdict = Verdict(wrong_bytes, [] if out["status"] == "pass" else out["reasons"] or ["failed"], emulation=emulation)
    return lines + verdict.lines()


# ----------------------------------------------------------------------------- JSON


def build_document(*, env: dict[str, Any], params: dict[str, Any], rows: list[dict[str, Any]],
                   shed: list[dict[str, Any]], out: dict[str, Any], artifacts: dict[str, Any],
                   argv: Sequence[str] | None = None, notes: Sequence[str] = ()) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "generated_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": list(argv if argv is not None else sys.argv),
        "gbps_definition": GBPS_DEFINITION,
        "environment": env,
        "parameters": params,
        "rows": rows,
        "shed": shed,
        "notes": list(notes),
        "summary": summary(rows),
        "outcome": out,
        "artifacts": artifacts,
    }


def dumps(doc: dict[str, Any]) -> str:
    return _dumps(doc)


def write_json_atomic(path: str, doc: dict[str, Any]) -> str:
    """``doc`` as strict JSON at ``path``, atomically, mode 0644 (:func:`gpuxfer.bench.cliutil.write_atomic`)."""
    from ..cliutil import write_atomic
    return write_atomic(path, dumps(doc) + "\n")


# ----------------------------------------------------------------------------- plots

_ENGINE_STYLE = {"triton": ("tab:blue", "o"), "pack": ("tab:green", "s"), "copy_engine": ("tab:red", "^"),
                 "triton-table": ("tab:cyan", "o"), "pack-table": ("tab:olive", "s"),
                 "copy_engine-table": ("tab:pink", "^"), "nixl": ("tab:purple", "D"), "mooncake": ("tab:orange", "v")}


def plot(rows: Sequence[dict[str, Any]], out_dir: str, *, title_suffix: str = "") -> list[str]:
    """One PNG per (workload, ISL): a panel per (direction, page), GB/s against batch, a line per engine,
    the bulk ceiling dashed. Invalid rows are drawn as red crosses. Returns the paths written."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    measured = [r for r in rows if r.get("p50_gbps") is not None and r.get("kind") != "bulk"]
    paths: list[str] = []
    for (wl, isl) in sorted({(r["workload"], r["isl_tokens"]) for r in measured}):
        rs = [r for r in measured if r["workload"] == wl and r["isl_tokens"] == isl]
        dirs = [d for d in ("pull", "push") if any(r["direction"] == d for r in rs)]
        pages = sorted({r["page_tokens"] for r in rs})
        # each panel its own y-axis: a page size's rates may be several times another's
        fig, axes = plt.subplots(len(dirs), len(pages), figsize=(5.2 * len(pages), 3.8 * len(dirs)),
                                 squeeze=False)
        for i, d in enumerate(dirs):
            for j, page in enumerate(pages):
                ax = axes[i][j]
                cell = [r for r in rs if r["direction"] == d and r["page_tokens"] == page]
                engines = []
                for r in cell:
                    if r["engine"] not in engines:
                        engines.append(r["engine"])
                for eng in engines:
                    pts = sorted((r for r in cell if r["engine"] == eng), key=lambda r: r["batch"])
                    xs = [r["batch"] for r in pts]
                    ys = [r["p50_gbps"] for r in pts]
                    if eng == "bulk":
                        if len(xs) == 1:    # one batch: a line of one point would not show
                            ax.axhline(ys[0], linestyle="--", color="black", linewidth=1.2, label="bulk (ceiling)")
                        else:
                            ax.plot(xs, ys, linestyle="--", color="black", linewidth=1.2, label="bulk (ceiling)")
                        continue
                    color, marker = _ENGINE_STYLE.get(eng, (None, "o"))
                    lo = [max(0.0, r["p50_gbps"] - (r.get("min_gbps") or r["p50_gbps"])) for r in pts]
                    hi = [max(0.0, (r.get("max_gbps") or r["p50_gbps"]) - r["p50_gbps"]) for r in pts]
                    ax.errorbar(xs, ys, yerr=[lo, hi], marker=marker, color=color, label=eng, linewidth=1.4,
                                markersize=4, capsize=2)
                    bad = [r for r in pts if not r.get("valid")]
                    if bad:
                        ax.scatter([r["batch"] for r in bad], [r["p50_gbps"] for r in bad], marker="x", s=70,
                                   color="red", zorder=5, label=f"{eng} INVALID")
                ax.set_xscale("log", base=2)
                batches = sorted({r["batch"] for r in cell})
                ax.set_xticks(batches)
                ax.set_xticklabels([str(b) for b in batches])
                ax.set_title(f"page {page}, {d}", fontsize=10)
                ax.set_xlabel("batch (requests per burst)")
                # rates over orders of magnitude (the emulation's interpreted engines beside its memcpy
                # ceiling): a log axis, or the slow engines' points would all lie on the zero line
                ys_all = [r["p50_gbps"] for r in cell if r["p50_gbps"] > 0]
                if ys_all and max(ys_all) > 100 * min(ys_all):
                    ax.set_yscale("log")
                    ax.set_ylabel("GB/s (p50, decimal; log scale)")
                else:
                    ax.set_ylabel("GB/s (p50, decimal)")
                    ax.set_ylim(bottom=0)
                ax.grid(True, alpha=0.3)
                ax.legend(fontsize=8, loc="best")
        fig.suptitle(f"gpuxfer bench kv: {wl}, ISL {isl}{title_suffix}", fontsize=11)
        fig.tight_layout()
        path = os.path.join(out_dir, f"kv_bench_{wl}_isl{isl}.png")
        buf = io.BytesIO()
        fig.savefig(buf, dpi=110, format="png")
        plt.close(fig)
        from ..cliutil import write_atomic
        write_atomic(path, buf.getvalue())
        paths.append(path)
    return paths


# ----------------------------------------------------------------------------- the live reporter


class Reporter:
    """Prints the table as rows arrive (with a rich progress bar on a terminal), then finalizes.

    Events come from the measuring process (rank 0), in-process under torchrun
    or through a queue into the parent when the command spawns its workers.
    ``machine_json`` sends the human table to stderr and prints the JSON
    document on stdout at the end.
    """

    def __init__(self, *, out_dir: str | None, machine_json: bool = False, argv: Sequence[str] | None = None,
                 plots: bool = True):
        from rich.console import Console
        self.out_dir = out_dir
        self.machine_json = machine_json
        self.argv = list(argv) if argv is not None else list(sys.argv)
        self.make_plots = plots
        stream = sys.stderr if machine_json else sys.stdout
        self.console = Console(file=stream, highlight=False, soft_wrap=True)
        self.env: dict[str, Any] = {}
        self.params: dict[str, Any] = {}
        self.rows: list[dict[str, Any]] = []
        self.shed: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.notes: list[str] = []
        self.expected: int | None = None
        self.complete = False
        self._progress = None
        self._task = None
        self._finished = False

    # -- printing
    def _print(self, line: str, *, prose: bool = False) -> None:
        """One line as it is (table rows keep their columns), or, with ``prose``, a ``# `` comment
        wrapped at 120 characters."""
        for ln in wrap_comments([line]) if prose else [line]:
            self.console.print(ln, markup=False, highlight=False, soft_wrap=True)

    def _start_progress(self) -> None:
        if not self.console.is_terminal or not self.expected:
            return
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)
        self._progress = Progress(TextColumn("[bold]kv bench[/]"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                  TextColumn("{task.description}"),
                                  console=self.console, transient=True)
        self._progress.start()
        self._task = self._progress.add_task("", total=self.expected)

    def _stop_progress(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    # -- events
    def handle(self, kind: str, payload: dict[str, Any]) -> None:
        if kind == "start":
            self.env, self.params = payload["env"], payload["params"]
            self.expected = payload.get("expected_rows")
            for line in preamble_lines(self.env, self.params):
                self._print(line, prose=True)
            for item in payload.get("shed", []):
                self.shed.append(item)
                self._print(format_shed(item), prose=True)
            for line in header_lines():
                self._print(line)
            self._start_progress()
        elif kind == "running":
            if self._progress is not None:
                self._progress.update(self._task, description=f"running: {payload['engine']} "
                                      f"{payload['direction']} page {payload['page_tokens']} batch {payload['batch']}")
        elif kind == "row":
            self.rows.append(payload)
            self._print(format_row(payload))
            if self._progress is not None:
                self._progress.update(self._task, advance=1)
        elif kind == "shed":
            self.shed.append(payload)
            self._print(format_shed(payload), prose=True)
            if self._progress is not None:
                self._progress.update(self._task, advance=payload.get("rows", 0))
        elif kind == "note":
            self.notes.append(payload["text"])
            self._print(f"# {payload['text']}", prose=True)
        elif kind == "error":
            self.errors.append(payload["text"])
            self._print(f"# ERROR: {payload['text']}")
        elif kind == "done":
            self.complete = True
        else:  # pragma: no cover - programming error
            raise ValueError(f"unknown report event {kind!r}")

    def error(self, text: str) -> None:
        self.handle("error", {"text": text})

    def finish(self) -> int:
        """Summary, JSON, plots, footer. Returns the exit code (0 only if everything passed)."""
        if self._finished:
            return getattr(self, "_rc", 1)
        self._finished = True
        self._stop_progress()
        artifacts: dict[str, Any] = {"json": None, "plots": []}
        plot_error = None
        if self.out_dir and self.make_plots and self.rows:
            try:
                artifacts["plots"] = plot(self.rows, self.out_dir,
                                          title_suffix=" (host EMULATION)" if self.env.get("is_emulation") else "")
            except Exception as exc:  # a plot failure must not lose the measurements
                plot_error = f"plotting failed: {type(exc).__name__}: {exc}"
        errors = list(self.errors) + ([plot_error] if plot_error else [])
        out = outcome(self.rows, errors, expected_rows=self.expected, complete=self.complete)
        self._outcome = out
        if self.out_dir:
            artifacts["json"] = os.path.join(self.out_dir, "kv_bench.json")
        doc = build_document(env=self.env, params=self.params, rows=self.rows, shed=self.shed, out=out,
                             artifacts=artifacts, argv=self.argv, notes=self.notes)
        if self.params.get("suite") and self.out_dir:
            from . import collectivex as CX
            artifacts["suite_json"] = []
            for eng, sdoc in CX.documents_from_rows(self.rows, self.env, errors=errors).items():
                path = os.path.join(self.out_dir, f"{self.params['suite']}_{eng}.json")
                write_json_atomic(path, sdoc)
                artifacts["suite_json"].append(path)
        if artifacts["json"]:
            write_json_atomic(artifacts["json"], doc)
        for line in summary_lines(doc["summary"]):
            self._print(line)
        wrong = sum(int(r.get("wrong_bytes") or 0) for r in self.rows)
        for line in footer_lines(out, artifacts, wrong_bytes=wrong, emulation=bool(self.env.get("is_emulation"))):
            self._print(line, prose=True)
        if self.machine_json:
            sys.stdout.write(dumps(doc) + "\n")
            sys.stdout.flush()
        rc = 0 if out["status"] == "pass" else EXIT_INTERRUPTED if out["status"] == "interrupted" else 1
        if self.params.get("suite") and rc != EXIT_INTERRUPTED:
            from . import collectivex as CX
            rc = CX.exit_code(self.rows, rc)
        self._rc = rc
        return rc
