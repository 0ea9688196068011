#!/usr/bin/env bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
O=/tmp/oK; mkdir -p $O; trap 'tar czf $OUT/runK.tgz -C $O .' EXIT
T0=$SECONDS
timeout 330 env PYTHONPATH=$PWD python3 -m pytest -q -m gpu -p no:cacheprovider tests/kv > $O/gpu_kv.txt 2>&1
echo "gpu kv rc=$? at $((SECONDS-T0)) s"; tail -n 4 $O/gpu_kv.txt
mkdir -p /tmp/sd && tar xzf .sglang-device/sglang-py.tgz -C /tmp/sd && python3 -m pip install -q --no-index --no-deps --target /tmp/sd .sglang-device/wheels/*.whl > $O/sd.log 2>&1
timeout 150 env PYTHONPATH=/tmp/sd:$PWD:$PWD/tests/integrations/sglang_stubs GPUXFER_REQUIRE_SGLANG=1 python3 -m pytest -q -m gpu -p no:cacheprovider tests/integrations/test_sglang_backend_gpu.py > $O/gpu_sglang.txt 2>&1
echo "gpu sglang rc=$? at $((SECONDS-T0)) s"; tail -n 4 $O/gpu_sglang.txt
