"""The CollectiveX suite's statistics, rows, documents and exit code (``run_kv.main``'s schema)."""
from __future__ import annotations

from typing import Any, Sequence

from ....errors import BadInput
from .suite import (BATCHES, DOC_VERSION, EXIT_VERIFY_FAILED, OPS, OUTCOME_REASON, PAYLOAD_UNIT, PRECISION, PRESET,
                    RECORD_TYPE, REPS_PER_TRIAL, SUITE_NAME, TRIALS, WARMUP_PER_TRIAL, WORKLOAD, _workload)


# ----------------------------------------------------------------------------- statistics and rows


def pcts(samples_ms: Sequence[float]) -> dict[str, float | int]:
    """The suite's statistics: p50 ``s[n // 2]``, p95 ``s[min(n - 1, int(n * 0.95))]``, min, max, n."""
    s = sorted(float(v) for v in samples_ms)
    if not s:
        raise BadInput("no timed samples")
    n = len(s)
    return {"p50": s[n // 2], "p95": s[min(n - 1, int(n * 0.95))], "min": s[0], "max": s[-1], "n": n}


def gbps_p50(req_bytes: int, batch: int, p50_ms: float) -> float:
    """``req_bytes * batch / p50_ms / 1e6`` (decimal GB/s of the burst)."""
    if not p50_ms > 0:
        raise BadInput(f"p50 must be positive, got {p50_ms!r} ms")
    return req_bytes * batch / p50_ms / 1e6


def _timed_fields(samples_ms: Sequence[float], req_bytes: int, batch: int, prep_ms: float) -> dict:
    st = pcts(samples_ms)
    return {"prep_ms": round(float(prep_ms), 3), "latency_ms": {k: round(v, 3) for k, v in st.items()},
            "gbps_p50": round(gbps_p50(req_bytes, batch, st["p50"]), 2)}


def paged_row(isl: int, page: int, batch: int, op: str, *, samples_ms: Sequence[float], prep_ms: float,
              verify: dict) -> dict[str, Any]:
    """A ``kind: paged`` row of the suite's schema (``page_bytes``: the first region's, as the suite labels it)."""
    w = _workload()
    req_bytes = w.bytes_per_request(isl, page)
    return {"kind": "paged", "preset": PRESET, "isl": isl, "page_tokens": page, "layers": _suite_layers(),
            "page_bytes": w.transfer_regions(page)[0].desc_bytes, "descs": w.descriptors_per_request(isl, page),
            "req_bytes": req_bytes, "batch": batch, "op": op,
            **_timed_fields(samples_ms, req_bytes, batch, prep_ms), "verify": dict(verify)}


def bulk_row(isl: int, nbytes: int, op: str, *, samples_ms: Sequence[float], prep_ms: float = 0.0) -> dict:
    """A ``kind: bulk`` row: one descriptor, batch 1, no verifying side (it passes by construction)."""
    return {"kind": "bulk", "preset": PRESET, "isl": isl, "page_tokens": None,
            "layers": _suite_layers(), "page_bytes": None, "descs": 1, "batch": 1, "req_bytes": nbytes, "op": op,
            **_timed_fields(samples_ms, nbytes, 1, prep_ms), "verify": {"passed": True, "detail": ""}}


def _suite_layers() -> int:
    """``plan_config``'s ``layers``: the sum of the preset's layer groups (30 CSA + 31 HCA = 61)."""
    return sum(r.layers for r in _workload().regions if r.name in ("csa", "hca"))


ROW_FIELDS: dict[str, tuple] = {
    "kind": (str,), "preset": (str,), "isl": (int,), "page_tokens": (int, type(None)), "layers": (int,),
    "page_bytes": (int, type(None)), "descs": (int,), "req_bytes": (int,), "batch": (int,), "op": (str,),
    "prep_ms": (int, float), "latency_ms": (dict,), "gbps_p50": (int, float), "verify": (dict,),
}
LATENCY_FIELDS = ("p50", "p95", "min", "max", "n")


def validate_row(row: dict) -> None:
    """Raise :class:`BadInput` naming the first field of ``row`` that the suite's schema rejects."""
    if not isinstance(row, dict):
        raise BadInput(f"a suite row must be a dict, got {type(row).__name__}")
    for key, types in ROW_FIELDS.items():
        if key not in row:
            raise BadInput(f"suite row lacks {key!r}")
        v = row[key]
        if isinstance(v, bool) or not isinstance(v, types):
            raise BadInput(f"suite row field {key!r} = {v!r} is not {' or '.join(t.__name__ for t in types)}")
    if row["kind"] not in ("paged", "bulk"):
        raise BadInput(f"suite row kind must be 'paged' or 'bulk', got {row['kind']!r}")
    if row["op"] not in OPS:
        raise BadInput(f"suite row op must be one of {', '.join(OPS)}, got {row['op']!r}")
    if row["kind"] == "paged" and (row["page_tokens"] is None or row["page_bytes"] is None):
        raise BadInput("a paged suite row needs page_tokens and page_bytes")
    if row["kind"] == "bulk" and (row["page_tokens"] is not None or row["descs"] != 1 or row["batch"] != 1):
        raise BadInput("a bulk suite row has page_tokens None, one descriptor and batch 1")
    lat = row["latency_ms"]
    for k in LATENCY_FIELDS:
        if k not in lat or isinstance(lat[k], bool) or not isinstance(lat[k], (int, float)):
            raise BadInput(f"suite row latency_ms lacks a number {k!r}")
    if not 0 < lat["min"] <= lat["p50"] <= lat["p95"] <= lat["max"]:
        raise BadInput(f"suite row latency_ms is not ordered min <= p50 <= p95 <= max: {lat}")
    v = row["verify"]
    if not isinstance(v.get("passed"), bool) or not isinstance(v.get("detail"), str):
        raise BadInput("suite row verify needs a bool 'passed' and a str 'detail'")


def document(rows: Sequence[dict], *, backend: str, fabric: str, runner: str, device_product: str | None,
             framework: str | None, vendor: str | None, library_version: str | None = None,
             generated_at: str | None = None, batches: Sequence[int] = BATCHES,
             reasons: Sequence[str] = (), extra: dict | None = None) -> dict:
    """One case-attempt document of the suite (``run_kv.main``'s ``doc``) for one backend's rows.

    The outcome is ``success`` only if every row's ``verify.passed`` and there is no other
    reason (``reasons``: gpuxfer's full verification, rows that failed to run); ``extra``
    (gpuxfer's own fields) lands under the ``gpuxfer`` key, which the suite's readers ignore.
    """
    import datetime as _dt
    rows = [dict(r) for r in rows]
    for r in rows:
        validate_row(r)
    sampled_ok = bool(rows) and all(r["verify"]["passed"] for r in rows)
    ok = sampled_ok and not reasons
    case = {"backend": backend, "workload": WORKLOAD, "mode": fabric, "phase": "xfer", "ep": 2,
            "routing": "paged", "precision": PRECISION, "suite": SUITE_NAME}
    doc = {
        "version": DOC_VERSION,
        "record_type": RECORD_TYPE,
        "generated_at": generated_at or _dt.datetime.now().astimezone().isoformat(),
        "identity": {
            "allocation_factors": {"run_attempt": None, "run_id": None, "source_sha": None},
            "attempt_ordinal": 1,
            "case_factors": {"case": case, "sku": runner},
            "case_id": f"{runner}:{backend}:{WORKLOAD}:{fabric}:{PRECISION}",
        },
        "workload": {"isl_ladder": sorted({r["isl"] for r in rows}),
                     "page_tokens": sorted({r["page_tokens"] for r in rows if r["page_tokens"] is not None}),
                     "batch_sizes": list(batches), "ops": [o for o in OPS if any(r["op"] == o for r in rows)],
                     "preset": _workload().as_dict()},
        "measurement": {"payload_unit": PAYLOAD_UNIT, "rows": rows,
                        "sampling": {"reps_per_trial": REPS_PER_TRIAL, "trials": TRIALS,
                                     "warmup_per_trial": WARMUP_PER_TRIAL}},
        "implementation": {"name": backend, "fabric": fabric, "library_version": library_version,
                           "maturity": "candidate"},
        "topology": {"device_product": device_product, "gpus_per_node": None, "nodes": None, "ranks_per_node": None,
                     "scale_up_domain": None, "scale_up_transport": None, "topology_class": None, "world_size": 2},
        "runtime": {"framework": framework, "vendor": vendor},
        "provenance": {"image": None, "source_sha": None},
        "outcome": {"reasons": ([] if sampled_ok else [OUTCOME_REASON]) + list(reasons),
                    "status": "success" if ok else "invalid"},
    }
    if extra:
        doc["gpuxfer"] = extra
    validate_document(doc)
    return doc


def validate_document(doc: dict) -> None:
    """Raise :class:`BadInput` naming the first field the suite's summary (``summarize.render_kv``) needs
    and ``doc`` lacks, then validate every row."""
    def get(path: str):
        cur: Any = doc
        for part in path.split("."):
            if not isinstance(cur, dict) or part not in cur:
                raise BadInput(f"suite document lacks {path!r}")
            cur = cur[part]
        return cur
    if get("version") != DOC_VERSION or isinstance(get("version"), bool):
        raise BadInput(f"suite document version must be the number {DOC_VERSION}")
    for path in ("identity.case_factors.sku", "identity.case_factors.case.backend",
                 "identity.case_factors.case.mode", "identity.case_factors.case.workload",
                 "identity.case_factors.case.precision", "outcome.status"):
        if not isinstance(get(path), str):
            raise BadInput(f"suite document field {path!r} must be a string")
    if get("identity.case_factors.case.suite") != SUITE_NAME:
        raise BadInput(f"suite document case.suite must be {SUITE_NAME!r}")
    if get("outcome.status") not in ("success", "invalid"):
        raise BadInput("suite document outcome.status must be 'success' or 'invalid'")
    rows = get("measurement.rows")
    if not isinstance(rows, list):
        raise BadInput("suite document measurement.rows must be a list")
    for r in rows:
        validate_row(r)
    ok = bool(rows) and all(r["verify"]["passed"] for r in rows)
    if get("outcome.status") == "success" and not ok:
        raise BadInput("suite document outcome.status disagrees with its rows' verify verdicts")


def suite_row_from(row: dict) -> dict | None:
    """The suite's row for one of gpuxfer's ``--suite collectivex`` rows (None if it has no timings), with
    gpuxfer's full verification beside the suite's ``verify`` as ``gpuxfer_full_verify``."""
    samples = row.get("samples_ms") or []
    if row.get("error") or not samples or row.get("kind") not in ("paged", "bulk"):
        return None
    prep = (row.get("prep_ms_by_side") or {}).get(row.get("initiator"), row.get("prep_ms") or 0.0)
    if row.get("kind") == "bulk":
        out = bulk_row(row["isl_tokens"], row["request_bytes"], row["direction"], samples_ms=samples, prep_ms=prep)
    else:
        out = paged_row(row["isl_tokens"], row["page_tokens"], row["batch"], row["direction"], samples_ms=samples,
                        prep_ms=prep, verify=row.get("suite_verify") or {"passed": False, "detail": "not checked"})
    wrong = row.get("wrong_bytes")
    out["gpuxfer_full_verify"] = {"passed": wrong == 0, "wrong_bytes": wrong, "detail": row.get("first_wrong") or ""}
    return out


def documents_from_rows(rows: Sequence[dict], env: dict, *, errors: Sequence[str] = ()) -> dict[str, dict]:
    """One suite document per engine of a ``--suite collectivex`` run (its rows, in the suite's schema)."""
    engines: list[str] = []
    for r in rows:
        if r.get("engine") not in engines:
            engines.append(r.get("engine"))
    devices = env.get("devices") or [{}]
    product = ((devices[0] or {}).get("info") or {}).get("name")
    versions = env.get("versions") or {}
    platform = env.get("platform")
    vendor = {"cuda": "nvidia", "rocm": "amd"}.get(platform, platform)
    fabric = (env.get("link") or {}).get("kind") or "unknown"
    docs = {}
    for eng in engines:
        mine = [r for r in rows if r.get("engine") == eng]
        suite_rows, reasons = [], list(errors)
        for r in mine:
            if r.get("kind") == "ceiling":     # gpuxfer's per-burst ceiling: not a row of the suite
                continue
            sr = suite_row_from(r)
            where = f"{r.get('kind', 'paged')} {r.get('direction')} isl {r.get('isl_tokens')} page " \
                    f"{r.get('page_tokens')} batch {r.get('batch')}"
            if sr is None:
                reasons.append(f"{where}: did not run ({r.get('error')})")
                continue
            if not sr["gpuxfer_full_verify"]["passed"]:
                reasons.append(f"{where}: gpuxfer's full verification found {sr['gpuxfer_full_verify']['wrong_bytes']} "
                               "wrong bytes")
            suite_rows.append(sr)
        extra = {"engine": eng, "platform": platform, "is_emulation": env.get("is_emulation"),
                 "full_verification": "every byte of every request, gpuxfer's seeded pattern (gpuxfer_full_verify)"}
        if not suite_rows:
            continue
        docs[eng] = document(suite_rows, backend=eng, fabric=fabric, runner=env.get("hostname") or "unknown",
                             device_product=product, framework=versions.get("torch"), vendor=vendor,
                             reasons=reasons, extra=extra)
    return docs


def exit_code(rows: Sequence[dict], rc: int) -> int:
    """The suite's exit code: 3 when a row failed a verification (sampled or full), else ``rc``."""
    failed = any((r.get("suite_verify") or {}).get("passed") is False or (r.get("wrong_bytes") or 0) > 0
                 for r in rows)
    return EXIT_VERIFY_FAILED if failed else rc
