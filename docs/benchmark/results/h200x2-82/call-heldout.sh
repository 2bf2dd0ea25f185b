#!/bin/bash
# The held-out check of ZeRO-3's stream pools (zero3-pools-heldout): 7B two 4k rows, 7B split 64K rows, 7B nf4 two rows; two GPUs each.
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c3; mkdir -p $C; nvidia-smi -L > $C/gpus.txt; git rev-parse HEAD >> $C/gpus.txt
r() { local name=$1 out=$2 t=$3
  [ $t -lt 60 ] && { echo "$out not started ($t s left)" >> $C/times.txt; return; }
  timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1
  echo "$out rc $? $SECONDS" >> $C/times.txt; }
r zerolab-qwen2.5-7b-2gpu-z3-mb2-ckpt mb2 220
r zerolab-qwen2.5-7b-2gpu-z3-sp2-rows64k-ckpt sp2-64k $((420-SECONDS))
r zerolab-qwen2.5-7b-2gpu-z3-nf4-mb2-ckpt nf4-mb2 $((540-SECONDS))
rm -rf $C/*/mlruns; tar czf $OUT/c3.tgz -C /tmp c3; cat $C/gpus.txt $C/times.txt
for d in mb2 sp2-64k nf4-mb2; do echo "$d $(grep -h '^| zerolab' $C/$d/benchmark.md | cut -c1-150)"; cut -d, -f1,5-13 $C/$d/bench_calibration.csv | tail -1; done
