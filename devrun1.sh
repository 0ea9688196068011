#!/usr/bin/env bash
# one device call: gpu tests, KV host costs with device IDs, pp default vs views receivers; all under one tarball
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=/tmp/o; mkdir -p $O; trap 'tar czf $OUT/run.tgz -C $O .' EXIT
nvidia-smi -L > $O/gpu.txt; nproc >> $O/gpu.txt
T0=$SECONDS
for i in 1 2 3; do for m in default views; do
  timeout 45 python3 -m gpuxfer bench pp --backend copy_engine --max-size 1M --no-contention --no-pingpong $([ $m = views ] && echo --recv-views) --json $O/pp-$m-$i.json > $O/pp-$m-$i.txt 2>&1; echo "pp $m $i rc=$? at $((SECONDS-T0)) s"
done; done
grep -h -A3 "target (any GPU)" $O/pp-*.txt | cut -c1-230
for r in 1 2 3; do
  timeout 60 python3 scripts/kv_host_costs.py --ids host,device --isl 32768,524288 --page 16 --ops pull,push --iters 30 --json $O/hc$r.json > $O/hc$r.log 2>&1; echo "hc $r rc=$? at $((SECONDS-T0)) s"
done
timeout 150 python3 -m pytest -v -m gpu tests/kv/test_kv_device_ids.py tests/kv/test_kv_post_many.py -p no:cacheprovider > $O/gpu_tests_kv.txt 2>&1
echo "kv gpu tests rc=$? at $((SECONDS-T0)) s"; tail -3 $O/gpu_tests_kv.txt
timeout 170 python3 -m pytest -v -m gpu tests/pp/test_pp_copy_out.py tests/pp/test_pp_step_calls.py tests/pp/test_pp_caller_streams.py tests/pp/test_pp_same_device.py -p no:cacheprovider > $O/gpu_tests_pp.txt 2>&1
echo "pp gpu tests rc=$? at $((SECONDS-T0)) s"; tail -3 $O/gpu_tests_pp.txt
