"""``gpuxfer doctor``: what this machine can do, and why not.

Reports the platform (the host emulation says so loudly), why every other
platform is unusable, library versions, each device with its capabilities,
the link matrix, for each stage-hand-off backend and KV engine whether it
can run here, and the ``GPUXFER_*`` variables set in the environment (the JSON
lists every variable's effective value). ``--json`` prints the same report as one JSON object.

Exit status: 0 whenever a platform could be opened and reported on, whatever
it found; 1 when none could (e.g. ``--platform cuda`` on a machine without a
usable GPU: the report then says why).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import platform as _pyplatform
import sys

from . import config
from . import __version__
from .errors import BadInput, PlatformUnavailable
from .platforms import PLATFORMS, detect, unavailable_reason

# (label, distribution names or a "prefix*" matching any distribution starting with it)
_DISTRIBUTIONS: list[tuple[str, str]] = [
    ("torch", "torch"), ("triton", "triton"), ("numpy", "numpy"), ("cupy", "cupy*"),
    ("cuda-bindings", "cuda-bindings"), ("nvidia-ml-py", "nvidia-ml-py"), ("nixl", "nixl*"),
    ("mooncake", "mooncake*"), ("mori-io", "amd-mori*"), ("hip-python", "hip-python"), ("rich", "rich"),
]

# (report key, module, function(platform) -> {name: reason or None})
_CAPABILITY_REPORTS = [
    ("pp_backends", "gpuxfer.pp.selection", "backend_report"),
    ("kv_engines", "gpuxfer.kv.engine_choice", "engine_report"),
    ("kv_routes", "gpuxfer.kv.nixl_route", "route_report"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--platform", choices=[*PLATFORMS, "auto"], default=None,
                        help="report on this platform instead of the detected one "
                             "(default: $GPUXFER_PLATFORM, else auto)")


# --------------------------------------------------------------------------- collecting


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def library_versions() -> dict[str, str]:
    """Installed versions of the libraries gpuxfer may use (read from metadata: nothing is imported)."""
    installed: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        try:
            installed[_norm(dist.metadata["Name"])] = dist.version
        except Exception:  # a broken metadata entry is not worth failing over
            continue
    out = {"python": f"{sys.version.split()[0]} ({sys.executable})", "gpuxfer": __version__,
           "os": _pyplatform.platform()}
    for label, spec in _DISTRIBUTIONS:
        if spec.endswith("*"):
            hits = sorted(f"{n} {v}" for n, v in installed.items() if n.startswith(spec[:-1]))
            out[label] = ", ".join(hits) if hits else "not installed"
        else:
            out[label] = installed.get(spec, "not installed")
    return out


def install_problems(versions: dict[str, str]) -> list[str]:
    """What is wrong with the installed libraries themselves (e.g. two CuPy builds at once)."""
    problems = []
    cupys = [v for v in versions.get("cupy", "").split(", ") if v and v != "not installed"]
    if len(cupys) > 1:
        problems.append(f"{len(cupys)} CuPy packages are installed at once ({', '.join(cupys)}): they share the "
                        "`cupy` module, so which one runs is unclear; keep the one matching the driver "
                        "(pip uninstall the others)")
    return problems


def capability_report(module: str, func: str, platform) -> tuple[dict[str, str | None] | None, str | None]:
    """``module.func(platform)`` -> (``{name: why-not or None}``, None), or (None, why there is no report)."""
    try:
        fn = getattr(importlib.import_module(module), func)
        return {str(k): (None if v is None else str(v)) for k, v in fn(platform).items()}, None
    except Exception as exc:  # the doctor reports a broken probe; it does not die of it
        return None, f"report failed: {type(exc).__name__}: {exc}"


def kv_slot_memory() -> dict:
    """What a KVAgent ``triton`` slot holds on the device beyond the registered caches, by ``GPUXFER_KV_COPY``:
    its request array (one int64 per block ID, both sides) and, with descriptor slots, a 24-byte row per
    descriptor (``KVAgent.device_bytes()`` counts both per agent)."""
    mode = config.get("GPUXFER_KV_COPY")
    return {"GPUXFER_KV_COPY": mode, "bytes_per_block_id": 8, "bytes_per_descriptor": 24 if mode == "descriptors" else 0}


def collect(platform_name: str | None = None) -> dict:
    """The whole report as plain data (what ``--json`` prints)."""
    report: dict = {"gpuxfer": __version__, "versions": library_versions(), "platform": None,
                    "platform_error": None, "skipped": {}, "devices": [], "links": []}
    report["problems"] = install_problems(report["versions"])
    report["config"] = config.report()
    try:
        det = detect(platform_name)
    except PlatformUnavailable as exc:
        report["platform_error"] = str(exc)
        report["skipped"] = {n: unavailable_reason(n) or "usable, but not selected" for n in PLATFORMS}
        if exc.platform in PLATFORMS:
            report["skipped"][exc.platform] = exc.reason
        return report
    plat = det.platform
    try:
        skipped = dict(det.skipped)
        for name in PLATFORMS:
            if name != plat.name and name not in skipped:
                skipped[name] = unavailable_reason(name) or "usable, but not selected"
        report["skipped"] = skipped
        report["platform"] = {"name": plat.name, "label": plat.label, "is_emulation": plat.is_emulation}
        try:
            report["versions"].update({f"{plat.name} {k}": str(v) for k, v in plat.versions().items()})
        except Exception as exc:
            report["versions"][f"{plat.name} versions"] = f"unavailable: {type(exc).__name__}: {exc}"
        n = plat.device_count()
        for d in range(n):
            try:
                report["devices"].append(plat.device_info(d).as_dict())
            except Exception as exc:
                report["devices"].append({"index": d, "error": f"{type(exc).__name__}: {exc}"})
        for s in range(n):
            for t in range(n):
                try:
                    report["links"].append(plat.link(s, t).as_dict())
                except Exception as exc:
                    report["links"].append({"src": s, "dst": t, "kind": "error", "peer_access": False,
                                            "detail": f"{type(exc).__name__}: {exc}"})
        for key, module, func in _CAPABILITY_REPORTS:
            report[key], report[f"{key}_note"] = capability_report(module, func, plat)
        report["kv_slot_memory"] = kv_slot_memory()
    finally:
        plat.close()
    return report


# --------------------------------------------------------------------------- rendering


def _gib(n) -> str:
    return "?" if n is None else f"{n / 2**30:.1f}"


def render(report: dict, console) -> None:
    """The report as rich tables. Every text from the report is escaped: ``gpuxfer[rocm]`` is not markup."""
    from rich.markup import escape as e
    from rich.panel import Panel

    plat = report["platform"]
    if plat is None:
        console.print(Panel(f"[bold red]no platform could be opened[/]\n{e(str(report['platform_error']))}",
                            title="gpuxfer doctor"))
    elif plat["is_emulation"]:
        console.print(Panel(f"[bold yellow]platform: {e(plat['label'])}[/]\n"
                            "[bold yellow]This is an EMULATION: transfers run on the CPU through shared memory. "
                            "It checks correctness and ordering; its timings say nothing about GPUs.[/]",
                            title="gpuxfer doctor", border_style="yellow"))
    else:
        console.print(Panel(f"[bold green]platform: {e(plat['label'])}[/]", title="gpuxfer doctor"))
    for problem in report.get("problems", []):
        console.print(f"[bold red]problem:[/] {e(problem)}")

    chosen = {k: v for k, v in report.get("config", {}).items() if v["set"]}
    if chosen:
        t = _table("configuration set in the environment (the rest at defaults: docs/CONFIGURATION.md)")
        t.add_column("variable")
        t.add_column("value")
        for k, v in chosen.items():
            t.add_row(e(k), f"[red]{e(v['error'])}[/]" if v["error"] else e(str(v["value"])))
        console.print(t)
    else:
        console.print("configuration: every GPUXFER_* variable at its default (docs/CONFIGURATION.md)")

    if report["skipped"]:
        t = _table("other platforms")
        t.add_column("platform")
        t.add_column("why not used")
        for name, why in report["skipped"].items():
            t.add_row(e(name), e(str(why)))
        console.print(t)

    t = _table("versions")
    t.add_column("library")
    t.add_column("version")
    for k, v in report["versions"].items():
        t.add_row(e(k), e(str(v)))
    console.print(t)

    devices = report["devices"]
    if devices:   # one column per device, one row per property
        t = _table("devices")
        t.add_column("")
        for d in devices:
            t.add_column(str(d["index"]))
        rows = [("name", "name", str), ("arch", "arch", str), ("total GiB", "total_bytes", _gib),
                ("free GiB", "free_bytes", _gib), ("SMs / CUs", "sm_count", str),
                ("copy engines", "copy_engines", str), ("64-bit stream mem ops", "stream_mem_ops_64", _yes),
                ("stream wait NOR", "stream_wait_nor", _yes), ("flush remote writes", "can_flush_remote_writes", _yes),
                ("PCI bus id", "pci_bus_id", lambda v: v or "-")]
        if any("error" in d for d in devices):
            t.add_row("error", *[f"[red]{e(d['error'])}[/]" if "error" in d else "" for d in devices])
        for label, key, fmt in rows:
            t.add_row(label, *["" if "error" in d else e(fmt(d[key])) for d in devices])
        console.print(t)
        notes = [tuple(d.get("notes", ())) for d in devices]
        if notes and all(n == notes[0] for n in notes):
            for note in notes[0]:
                console.print(f"  all devices: {e(note)}")
        else:
            for d, ns in zip(devices, notes):
                for note in ns:
                    console.print(f"  device {d['index']}: {e(note)}")

    n = len(report["devices"])
    if n > 1:
        kinds = {(ln["src"], ln["dst"]): ln for ln in report["links"]}
        t = _table("links (row: source, column: destination)")
        t.add_column("")
        for j in range(n):
            t.add_column(str(j))
        for i in range(n):
            cells = []
            for j in range(n):
                ln = kinds.get((i, j))
                cells.append("?" if ln is None else ("-" if i == j else e(ln["kind"]) +
                                                     ("" if ln["peer_access"] else " (no peer access)")))
            t.add_row(str(i), *cells)
        console.print(t)

    for key, title in (("pp_backends", "stage hand-off backends"), ("kv_engines", "KV engines"),
                       ("kv_routes", "KVAgent routes to peers")):
        if plat is None:
            continue
        entries, note = report.get(key), report.get(f"{key}_note")
        if entries is None:
            console.print(f"[bold]{title}:[/] {e(str(note))}")
            continue
        t = _table(title)
        t.add_column("name")
        t.add_column("usable here")
        for name, why in entries.items():
            t.add_row(e(name), "[green]yes[/]" if why is None else f"[red]no[/]: {e(why)}")
        console.print(t)
        if key == "kv_engines" and report.get("kv_slot_memory"):
            m = report["kv_slot_memory"]
            more = (f" and a {m['bytes_per_descriptor']}-byte row per descriptor" if m["bytes_per_descriptor"]
                    else ", no descriptor table")
            console.print(f"  triton slots (GPUXFER_KV_COPY={e(m['GPUXFER_KV_COPY'])}): device memory per slot is its "
                          f"request's block IDs, {m['bytes_per_block_id']} B each{more} (KVAgent.device_bytes())")


def _table(title: str):
    """A table whose title stays on one line however narrow its rows are (as wide as the console allows)."""
    from rich.table import Table
    return Table(title=title, title_justify="left", min_width=len(title) + 2)


def _yes(v) -> str:
    return "yes" if v else "no"


def run(args: argparse.Namespace) -> int:
    name = args.platform or config.get("GPUXFER_PLATFORM")
    if name is not None and name not in (*PLATFORMS, "auto"):
        print(f"gpuxfer doctor: error: GPUXFER_PLATFORM={name!r} is not a platform; known: "
              f"{', '.join(PLATFORMS)}, auto", file=sys.stderr)
        return 2
    try:
        report = collect(args.platform)
    except BadInput as exc:     # e.g. GPUXFER_HOST_DEVICES=abc: the message names the variable
        print(f"gpuxfer doctor: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        from rich.console import Console
        render(report, Console())
    return 0 if report["platform"] is not None else 1
