#!/bin/bash
# The allocator's history of the three ZeRO-3 runs whose reserved memory the estimate's share misses
# (7B split 32K rows, 7B nf4, 14B nf4; two GPUs each), written up per rank by jobs/benchmark.py --memory-trace.
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c1; mkdir -p $C; nvidia-smi -L > $C/gpus.txt; git rev-parse HEAD >> $C/gpus.txt
r() { local name=$1 out=$2 t=$3
  [ $t -lt 60 ] && { echo "$out not started ($t s left)" >> $C/times.txt; return; }
  timeout $t python jobs/benchmark.py --skip-checks --memory-trace --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1
  echo "$out rc $? $SECONDS" >> $C/times.txt; }
r zerolab-qwen2.5-7b-2gpu-z3-sp2-rows32k-ckpt sp2-32k 240
r zerolab-qwen2.5-7b-2gpu-z3-nf4-mb1-ckpt nf4-7b $((400-SECONDS))
r zerolab-qwen2.5-14b-2gpu-z3-nf4-mb1-ckpt nf4-14b $((560-SECONDS))
[ $SECONDS -lt 470 ] && { timeout $((580-SECONDS)) python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_tier.py -k memory_snapshot > $C/gpu-test.log 2>&1; echo "gpu-test rc $? $SECONDS" >> $C/times.txt; tail -3 $C/gpu-test.log; }
rm -rf $C/*/mlruns; tar czf $OUT/c1.tgz -C /tmp c1; cat $C/gpus.txt $C/times.txt
for d in sp2-32k nf4-7b nf4-14b; do echo "== $d"; grep -h '^| zerolab' $C/$d/benchmark.md | cut -c1-200; sed -n '/reserved beyond/,/^=====/p' $C/$d/*.memory.txt | head -45; done
