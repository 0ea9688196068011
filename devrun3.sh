#!/usr/bin/env bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 SGLANG_HOST_IP=127.0.0.1
O=/tmp/o3; mkdir -p $O; trap 'tar czf $OUT/run3.tgz -C $O .' EXIT
T0=$SECONDS
PYTHONPATH=$PWD timeout 60 python3 -m gpuxfer bench pp --backend copy_engine --max-size 64K --no-contention --no-pingpong --profile 64K > $O/pp-prof-default.txt 2>&1
echo "pp profile rc=$? at $((SECONDS-T0)) s"
for r in 1 2 3; do
  PYTHONPATH=$PWD timeout 60 python3 scripts/kv_host_costs.py --ids host,device --isl 32768,524288 --page 16 --ops pull,push --iters 30 --json $O/hc$r.json > $O/hc$r.log 2>&1; echo "hc $r rc=$? at $((SECONDS-T0)) s"
done
mkdir -p /tmp/sd && tar xzf .sglang-device/sglang-py.tgz -C /tmp/sd && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sd .sglang-device/wheels/*.whl > $O/sd.log 2>&1
timeout 150 env PYTHONPATH=/tmp/sd:$PWD:$PWD/tests/integrations/sglang_stubs GPUXFER_REQUIRE_SGLANG=1 python3 -m pytest -v -m gpu tests/integrations/test_sglang_backend_gpu.py -p no:cacheprovider > $O/sglang_gpu_test.txt 2>&1
echo "sglang gpu test rc=$? at $((SECONDS-T0)) s"; tail -n 4 $O/sglang_gpu_test.txt
