#!/usr/bin/env bash
# The GPU check: the `gpu` tests, doctor and the benchmarks, in one go, with every
# artifact under $OUT (default ./gpu-out). Run from the repo root on a GPU machine:
#   bash scripts/gpu-check.sh [quick|full]
# Runs from the source tree (PYTHONPATH=.), so nothing needs installing where torch,
# triton, cupy and cuda-bindings already are.
set -uo pipefail
mode=${1:-full}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Never use NVLink multicast on shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
status=0
step() {  # step NAME TIMEOUT_S CMD...: run, log to $OUT/NAME.log, remember failures
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=20 "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || status=1
}
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true
step doctor 120 $PY -m gpuxfer doctor
step gpu-tests 420 $PY -m pytest -m gpu -q -p no:cacheprovider tests
if [ "$mode" = full ]; then
  step bench-kernels 180 $PY -m gpuxfer bench kernels --json "$OUT/bench-kernels.json"
  step bench-pp 240 $PY -m gpuxfer bench pp --json "$OUT/bench-pp.json"
  step bench-kv 330 $PY -m gpuxfer bench kv --out "$OUT/kv"
  step example-kv 120 $PY examples/kv_handoff.py
  step example-pp 120 $PY examples/pp_two_stage.py
fi
exit $status
