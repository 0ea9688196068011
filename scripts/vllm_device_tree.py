#!/usr/bin/env python3
"""Prepare vLLM 0.33's pure-Python tree, and the small wheels its scheduler's imports need, for a GPU
machine with no network (its torch is its own; vLLM's compiled extensions are not needed by the
connector's tests and are left out).

    python scripts/vllm_device_tree.py --wheel vllm-0.33.0-...whl --out .vllm-device   # an ignored folder, carried
    # then, on the device, from the repository root:
    #   mkdir -p /tmp/vd && tar xzf .vllm-device/vllm-py.tgz -C /tmp/vd
    #   pip install --no-index --no-deps --target /tmp/vd .vllm-device/wheels/*.whl
    #   PYTHONPATH="$PWD:/tmp/vd" GPUXFER_REQUIRE_VLLM=1 python -m pytest -m gpu tests/integrations/test_vllm_connector_gpu.py

vLLM's Python sources (``*.py``, ``*.json``, ``*.jinja``, ``*.txt``; ~55 MB) travel as one tar.gz (~11 MB):
the wheel's compiled extensions, kernel sources and headers (~120 MB) are left out.

``--skip`` names packages the device already has (default: torch, triton, numpy, transformers and
their dependencies). The script prints the tree's size: a device call carries at most 64 MiB.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
REQS = os.path.join(HERE, "..", "tests", "integrations", "requirements-vllm.txt")
KEEP = (".py", ".json", ".jinja", ".txt")
# what the requirements pull in that the device image lacks (seen with vLLM 0.33 and the device of 2026-11;
# openai 3.x imports httpx2)
EXTRA = ["pydantic", "pydantic-core", "annotated-types", "typing-inspection", "starlette", "jiter", "sniffio",
         "apache-tvm-ffi", "httpx2", "httpcore2", "truststore", "h11", "anyio", "idna"]
DEVICE_HAS = {"numpy", "packaging", "psutil", "regex", "transformers", "requests", "pillow", "torch", "triton"}


def extract(wheel: str, out: str) -> int:
    """vLLM's Python sources from the wheel as ``out``/vllm-py.tgz; returns the bytes packed (uncompressed)."""
    import io
    import tarfile
    total = 0
    with zipfile.ZipFile(wheel) as z, tarfile.open(os.path.join(out, "vllm-py.tgz"), "w:gz") as tar:
        for info in z.infolist():
            name = info.filename
            if not name.startswith("vllm/") or info.is_dir() or not name.endswith(KEEP):
                continue
            data = z.read(info)
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
            total += len(data)
    return total


def requirements(skip: set[str]) -> list[str]:
    out = []
    with open(REQS) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            name = line.split("=")[0].split("<")[0].split(">")[0].strip().lower()
            if name not in skip:
                out.append(line)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheel", required=True, help="vllm-0.33.0-*.whl")
    ap.add_argument("--out", required=True, help="directory to fill (vllm-py.tgz and wheels/)")
    ap.add_argument("--python-version", default="3.12", help="the device's Python (for wheel selection)")
    ap.add_argument("--skip", default=",".join(sorted(DEVICE_HAS)), help="packages the device already has")
    a = ap.parse_args(argv)
    wheels = os.path.join(a.out, "wheels")
    os.makedirs(wheels, exist_ok=True)
    n = extract(a.wheel, a.out)
    reqs = requirements({s.strip().lower() for s in a.skip.split(",") if s.strip()})
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           a.python_version, "--implementation", "cp",
           *[x for n in (17, 24, 27, 28, 31) for x in ("--platform", f"manylinux_2_{n}_x86_64")],
           "--platform", "manylinux2014_x86_64", "--platform", "any", "-d", wheels, *reqs, *EXTRA]
    subprocess.run(cmd, check=True)
    w = sum(os.path.getsize(os.path.join(wheels, f)) for f in os.listdir(wheels))
    t = os.path.getsize(os.path.join(a.out, "vllm-py.tgz"))
    print(f"vLLM sources {n / 2**20:.1f} MiB as {t / 2**20:.1f} MiB in {a.out}/vllm-py.tgz; {len(os.listdir(wheels))} wheels {w / 2**20:.1f} MiB in {wheels}; "
          f"total {(t + w) / 2**20:.1f} MiB (a device call carries 64 MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
