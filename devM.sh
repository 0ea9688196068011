#!/usr/bin/env bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_LOGGING_LEVEL=WARNING
O=/tmp/oM; mkdir -p $O; trap 'tar czf $OUT/runM.tgz -C $O .' EXIT
T0=$SECONDS
nproc > $O/cpus.txt; lscpu | grep -i "model name\|MHz" >> $O/cpus.txt; date -u >> $O/cpus.txt
mkdir -p /tmp/vd && tar xzf .vllm-device/vllm-py.tgz -C /tmp/vd && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vd .vllm-device/wheels/*.whl > $O/vd.log 2>&1
timeout 200 env PYTHONPATH=/tmp/vd:$PWD python3 scripts/vllm_connector_bench.py --device cuda --tokens 32768 --runs 3 --out $O/vllm_auto.json > $O/vllm_auto.txt 2>&1
echo "vllm bench auto rc=$? at $((SECONDS-T0)) s"; grep -E "^ +[0-9] |^#" $O/vllm_auto.txt | tail -15
timeout 120 env PYTHONPATH=$PWD python3 -m pytest -q -m gpu -p no:cacheprovider tests/kv/test_kv_folded_posts.py tests/kv/test_kv_post_many.py > $O/gpu_tests.txt 2>&1
echo "gpu tests rc=$? at $((SECONDS-T0)) s"; tail -n 2 $O/gpu_tests.txt
