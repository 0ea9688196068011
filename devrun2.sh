#!/usr/bin/env bash
# one device call: the vLLM connector and the SGLang backend, their GPU tests and benchmarks; one tarball
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 SGLANG_HOST_IP=127.0.0.1
O=/tmp/o2; mkdir -p $O; trap 'tar czf $OUT/run2.tgz -C $O .' EXIT
T0=$SECONDS
mkdir -p /tmp/vd /tmp/sd && tar xzf .vllm-device/vllm-py.tgz -C /tmp/vd && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vd .vllm-device/wheels/*.whl > $O/vd.log 2>&1
tar xzf .sglang-device/sglang-py.tgz -C /tmp/sd && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sd .sglang-device/wheels/*.whl > $O/sd.log 2>&1
echo "trees at $((SECONDS-T0)) s"
V="env PYTHONPATH=$PWD:/tmp/vd"
timeout 240 $V python3 scripts/vllm_connector_bench.py --device cuda --tokens 32768 --runs 3 --out $O/vllm.json > $O/vllm.txt 2>&1
echo "vllm bench rc=$? at $((SECONDS-T0)) s"; tail -n 16 $O/vllm.txt | cut -c1-220
timeout 90 $V GPUXFER_REQUIRE_VLLM=1 python3 -m pytest -q -m gpu tests/integrations/test_vllm_connector_gpu.py -p no:cacheprovider > $O/vllm_gpu_test.txt 2>&1
echo "vllm gpu test rc=$? at $((SECONDS-T0)) s"; tail -n 2 $O/vllm_gpu_test.txt
S="env PYTHONPATH=/tmp/sd:$PWD:$PWD/tests/integrations/sglang_stubs"
timeout 90 $S GPUXFER_REQUIRE_SGLANG=1 python3 -m pytest -q -m gpu tests/integrations/test_sglang_backend_gpu.py -p no:cacheprovider > $O/sglang_gpu_test.txt 2>&1
echo "sglang gpu test rc=$? at $((SECONDS-T0)) s"; tail -n 2 $O/sglang_gpu_test.txt
for i in 1 2 3; do
  timeout 60 $S python3 scripts/sglang_backend_bench.py --platform cuda --json $O/sglang-$i.json > $O/sglang-$i.txt 2>&1
  echo "sglang bench $i rc=$? at $((SECONDS-T0)) s"; grep -i "target\|MISSED\|met" $O/sglang-$i.txt | cut -c1-200 | head -4
done
