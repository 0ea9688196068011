#!/usr/bin/env bash
# The GPU check: the `gpu` tests, doctor and the benchmarks, in one go, with every
# artifact under $OUT (default ./gpu-out). Run from the repo root on a GPU machine:
#   bash scripts/gpu-check.sh [tests|bench|full|blocks]
# tests: doctor, the hot paths' host costs (stage hand-off calls, the KV API per request),
# `pytest -m gpu` (both examples included), bench kernels; bench: bench pp, bench kv, NIXL against
# our engines (where a NIXL module imports), bench kv under torchrun; full: both. Each half fits a
# 10-minute call on 2x H200. blocks: the KV agent's two kinds of slot (GPUXFER_KV_COPY: blocks, the default,
# and descriptors): the block copy's gpu tests, the agent's gpu tests with descriptor slots, mode 5's tilings
# against the expansion + descriptor copy (bench kernels --tilings), and the host costs of both modes
# (about 8 minutes on one H200, cold kernel cache).
# Runs from the source tree (PYTHONPATH=.), so nothing needs installing where torch,
# triton, cupy and cuda-bindings already are.
set -uo pipefail
mode=${1:-full}
case $mode in tests|bench|full|blocks) ;; *) echo "usage: $0 [tests|bench|full|blocks]" >&2; exit 2;; esac
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
if [ "$mode" = blocks ]; then
  step block-copy-tests 240 $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/kernels
  GPUXFER_KV_COPY=descriptors step descriptor-slots-kv-tests 300 $PY -m pytest -m gpu -q -p no:cacheprovider -rs \
    tests/kv/test_kv_agent_transfers.py tests/kv/test_kv_post_many.py tests/kv/test_kv_device_ids.py \
    tests/kv/test_kv_folded_posts.py tests/kv/test_kv_block_slots.py tests/kv/test_kv_token_rows.py \
    tests/kv/test_kv_layer_at.py tests/kv/test_kv_agent_routes.py
  step blocks-tilings 240 $PY -m gpuxfer bench kernels --ops pull,blocks --sizes 576,2304,9216 --sweep "" \
    --tilings r16w8u4n4,r32w8u4n8,r64w8u4n8,r64w8u2n8p1,r32w16u2n8 --json "$OUT/bench-kernels-tilings.json"
  for copy in descriptors blocks; do
    GPUXFER_KV_COPY=$copy step kv-host-costs-$copy 150 $PY scripts/kv_host_costs.py --isl 32768 --page 16 \
      --engines triton --ops pull --ids device --batch 64 --profile --json "$OUT/kv-host-costs-$copy.json"
  done
  exit $status
fi
if [ "$mode" != bench ]; then
  nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true
  step doctor 120 $PY -m gpuxfer doctor
  step host-costs 60 $PY scripts/host_costs.py --json "$OUT/host-costs.json"
  step kv-host-costs 120 $PY scripts/kv_host_costs.py --json "$OUT/kv-host-costs.json"
  step gpu-tests 420 $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests
  step bench-kernels 120 $PY -m gpuxfer bench kernels --json "$OUT/bench-kernels.json"
fi
if [ "$mode" != tests ]; then
  step bench-pp 150 $PY -m gpuxfer bench pp --json "$OUT/bench-pp.json"
  step bench-kv 150 $PY -m gpuxfer bench kv --out "$OUT/kv"
  step torchrun 120 $PY -m torch.distributed.run --nproc-per-node 2 -m gpuxfer bench kv --out "$OUT/kv-torchrun" \
    --isl 8k --page 64 --batch 1,4 --trials 3
  if $PY -c 'import importlib, os; importlib.import_module(os.environ.get("GPUXFER_NIXL_MODULE", "nixl"))' 2>/dev/null
  then  # NIXL and our engines on the same descriptors (per-descriptor NIXL: few trials)
    step bench-kv-nixl 300 $PY -m gpuxfer bench kv --out "$OUT/kv-nixl" --workload kv-dsv4 --isl 32k \
      --page 16,64 --batch 1,8 --direction pull,push --trials 2 --warmup 1 \
      --engine nixl,nixl-oneshot,nixl+pack,nixl-bulk,mooncake,triton,pack,bulk
  else
    echo "=== bench-kv-nixl: skipped (no NIXL module imports; docs/MULTINODE.md: the slim NIXL tree)"
  fi
fi
exit $status
