#!/usr/bin/env python3
"""Prepare SGLang 0.5.23's pure-Python tree, the small wheels its disaggregation import chain needs, and the
gpuxfer plugin's entry point, for a GPU machine with no network (its torch and triton are its own; SGLang's
compiled kernels are not needed by the transfer backend's tests and benchmark). Run it in the SGLang venv
(docs/SGLANG.md), from the repository root:

    python scripts/sglang_device_tree.py --out .sglang-device       # an ignored folder (.gitignore), carried
    # then, on the device, from the repository root:
    #   mkdir -p /tmp/sd && tar xzf .sglang-device/sglang-py.tgz -C /tmp/sd
    #   python -m pip install -q --no-index --no-deps --target /tmp/sd .sglang-device/wheels/*.whl
    #   PYTHONPATH="/tmp/sd:$PWD" python scripts/sglang_backend_bench.py --platform cuda --json $OUT/bench.json

``sglang-py.tgz`` holds SGLang's ``*.py`` files as installed here (``sglang/test``, ``sglang/benchmark`` and
``sglang/multimodal_gen`` left out; the JIT kernel source folders, which its imports look for, empty), its
``dist-info`` metadata, and a ``gpuxfer`` ``dist-info`` holding only
the ``sglang.srt.plugins`` entry point, so SGLang's ``load_plugins()`` finds the backend while gpuxfer itself
comes from the checkout on ``PYTHONPATH``. ``wheels/`` holds, for ``--python-version`` on manylinux x86_64,
every distribution the ranks import (found by importing the chain here, in a child process) at the version
installed here, but those the device has (``--skip``; its transformers 5.17.0 serves SGLang's import chain
where 5.19.0 is pinned here: ``--skip`` without ``transformers`` carries 5.19.0, 12.6 MB more). The script
prints the sizes (~20 MiB with the default ``--skip``): a device call carries at most 64 MiB.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LEAVE_OUT = ("sglang/test/", "sglang/benchmark/", "sglang/multimodal_gen/")
# folders SGLang's import chain checks exist (its JIT kernel sources' location), carried empty
EMPTY_DIRS = ("sglang/kernels/jit/include", "sglang/kernels/jit/csrc")
# what the device's image has (seen 2026-12-02: Python 3.12.3, torch 2.11.0+cu130, triton 3.6.0, transformers
# 5.17.0 and its dependencies, numpy, pillow, aiohttp, ...): its versions serve; the rest travels as wheels
DEVICE_HAS = {"torch", "triton", "numpy", "filelock", "fsspec", "jinja2", "markupsafe", "mpmath", "networkx",
              "sympy", "setuptools", "gpuxfer", "sglang", "transformers", "tokenizers", "huggingface-hub",
              "safetensors", "pillow", "psutil", "regex", "requests", "pyyaml", "tqdm", "aiohttp", "aiohappyeyeballs",
              "aiosignal", "multidict", "yarl", "frozenlist", "propcache", "anyio", "attrs", "certifi", "idna",
              "charset-normalizer", "click", "einops", "h11", "httpx", "pygments", "rich", "sentencepiece",
              "typing-extensions", "urllib3", "packaging"}
_IMPORTS = r"""
import importlib.metadata as md, json, sys, warnings
warnings.simplefilter("ignore")
from sglang.srt.plugins import load_plugins
load_plugins()
import sglang.srt.disaggregation.prefill, sglang.srt.disaggregation.decode, sglang.srt.disaggregation.common.conn
import sglang.srt.mem_cache.memory_pool, gpuxfer.integrations.sglang.conn, sglang_queues, sglang_instance
pd = md.packages_distributions()
dists = {d for m in list(sys.modules) for d in pd.get(m.split(".")[0], [])}
print(json.dumps(sorted((d, md.version(d)) for d in dists)))
"""


def imported_distributions() -> list[tuple[str, str]]:
    """``(name, version)`` of every distribution a rank process imports, as installed in this venv."""
    tests = os.path.join(ROOT, "tests", "integrations")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(tests, "sglang_stubs"), tests, ROOT]))
    out = subprocess.run([sys.executable, "-c", _IMPORTS], env=env, capture_output=True, text=True, check=True,
                         timeout=600).stdout
    return [tuple(x) for x in json.loads(out.strip().splitlines()[-1])]


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    tar.addfile(ti, io.BytesIO(data))


def pack_sglang(out: str) -> int:
    """SGLang's Python files, its dist-info and the plugin's entry point as ``out``/sglang-py.tgz; returns the
    bytes packed (uncompressed)."""
    import importlib.metadata as md
    import sglang
    site = os.path.dirname(os.path.dirname(os.path.abspath(sglang.__file__)))
    total = 0
    with tarfile.open(os.path.join(out, "sglang-py.tgz"), "w:gz") as tar:
        for dirpath, dirnames, files in os.walk(os.path.join(site, "sglang")):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in files:
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, site).replace(os.sep, "/")
                if f.endswith(".py") and not rel.startswith(LEAVE_OUT):
                    tar.add(path, rel)
                    total += os.path.getsize(path)
        for d in EMPTY_DIRS:
            ti = tarfile.TarInfo(d)
            ti.type, ti.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(ti)
        dist = md.distribution("sglang")
        info = f"sglang-{dist.version}.dist-info"
        for f in ("METADATA", "entry_points.txt", "top_level.txt"):
            text = dist.read_text(f)
            if text is not None:
                _add(tar, f"{info}/{f}", text.encode())
        _add(tar, "gpuxfer-0.0.0+checkout.dist-info/METADATA",
             b"Metadata-Version: 2.1\nName: gpuxfer\nVersion: 0.0.0+checkout\n")
        _add(tar, "gpuxfer-0.0.0+checkout.dist-info/entry_points.txt",
             b"[sglang.srt.plugins]\ngpuxfer = gpuxfer.integrations.sglang.plugin:register\n")
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".sglang-device", help="directory to fill (default .sglang-device)")
    ap.add_argument("--python-version", default="3.12", help="the device's Python (for wheel selection)")
    ap.add_argument("--skip", default=",".join(sorted(DEVICE_HAS)), help="distributions the device already has")
    a = ap.parse_args(argv)
    skip = {s.strip().lower().replace("_", "-") for s in a.skip.split(",") if s.strip()}
    wheels = os.path.join(a.out, "wheels")
    os.makedirs(wheels, exist_ok=True)
    n = pack_sglang(a.out)
    reqs = [f"{d}=={v}" for d, v in imported_distributions() if d.lower().replace("_", "-") not in skip]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           a.python_version, "--implementation", "cp",
           *[x for v in (17, 24, 27, 28, 31, 34) for x in ("--platform", f"manylinux_2_{v}_x86_64")],
           "--platform", "manylinux2014_x86_64", "--platform", "any", "-d", wheels, *reqs]
    subprocess.run(cmd, check=True, timeout=1200)
    w = sum(os.path.getsize(os.path.join(wheels, f)) for f in os.listdir(wheels))
    t = os.path.getsize(os.path.join(a.out, "sglang-py.tgz"))
    print(f"SGLang sources {n / 2**20:.1f} MiB as {t / 2**20:.1f} MiB in {a.out}/sglang-py.tgz; "
          f"{len(os.listdir(wheels))} wheels {w / 2**20:.1f} MiB in {wheels}: {', '.join(sorted(reqs))}; "
          f"total {(t + w) / 2**20:.1f} MiB (a device call carries 64 MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
