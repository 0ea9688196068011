#!/usr/bin/env python3
"""Prepare vLLM 0.33's pure-Python tree, and the small wheels its scheduler's imports need, for a GPU
machine with no network (its torch is its own; vLLM's compiled extensions are not needed by the
connector's tests and are left out).

    python scripts/vllm_device_tree.py --wheel vllm-0.33.0-...whl --out shared/vllm-device
    # then, on the device, from the repository root:
    #   pip install --no-index --no-deps --target "$TMPDIR/vd" shared/vllm-device/wheels/*.whl
    #   PYTHONPATH="shared/vllm-device/py:$TMPDIR/vd" GPUXFER_REQUIRE_VLLM=1 \\
    #     python -m pytest -m gpu tests/integrations/test_vllm_connector_gpu.py

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
DEVICE_HAS = {"numpy", "packaging", "psutil", "regex", "transformers", "requests", "pillow", "torch", "triton"}


def extract(wheel: str, out: str) -> int:
    """vLLM's files from the wheel, less compiled extensions and their data; returns the bytes written."""
    total = 0
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            if not name.startswith("vllm/") or name.endswith((".so", ".cubin", ".fatbin")) or info.is_dir():
                continue
            z.extract(info, out)
            total += info.file_size
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
    ap.add_argument("--out", required=True, help="directory to fill (py/ and wheels/)")
    ap.add_argument("--python-version", default="3.12", help="the device's Python (for wheel selection)")
    ap.add_argument("--skip", default=",".join(sorted(DEVICE_HAS)), help="packages the device already has")
    a = ap.parse_args(argv)
    py = os.path.join(a.out, "py")
    wheels = os.path.join(a.out, "wheels")
    os.makedirs(py, exist_ok=True)
    os.makedirs(wheels, exist_ok=True)
    n = extract(a.wheel, py)
    reqs = requirements({s.strip().lower() for s in a.skip.split(",") if s.strip()})
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           a.python_version, "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64",
           "--platform", "any", "-d", wheels, *reqs]
    subprocess.run(cmd, check=True)
    w = sum(os.path.getsize(os.path.join(wheels, f)) for f in os.listdir(wheels))
    print(f"vLLM tree {n / 2**20:.1f} MiB in {py}; {len(os.listdir(wheels))} wheels {w / 2**20:.1f} MiB in {wheels}; "
          f"total {(n + w) / 2**20:.1f} MiB (a device call carries 64 MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
