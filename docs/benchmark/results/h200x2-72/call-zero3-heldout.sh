#!/bin/bash
# The held-out check of ZeRO-3's measured reserved share (zero3-cache-heldout): 0.5B nf4, 7B nf4, 7B split 32K rows; two GPUs each.
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c3; mkdir -p $C; nvidia-smi -L > $C/gpus.txt; git rev-parse HEAD >> $C/gpus.txt
r() { local name=$1 out=$2 t=$3
  timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1
  echo "$out rc $? $SECONDS" >> $C/times.txt; }
r zerolab-qwen2.5-0.5b-2gpu-z3-nf4-mb2 nf4-05b 150
r zerolab-qwen2.5-7b-2gpu-z3-nf4-mb1-ckpt nf4-7b 280
r zerolab-qwen2.5-7b-2gpu-z3-sp2-rows32k-ckpt sp2-32k $((540-SECONDS))
rm -rf $C/*/mlruns; tar czf $OUT/c3.tgz -C /tmp c3; cat $C/gpus.txt $C/times.txt
for d in nf4-05b nf4-7b sp2-32k; do echo "$d $(grep -h '^| zerolab' $C/$d/benchmark.md | cut -c1-150)"; cut -d, -f1-40 $C/$d/bench_calibration.csv | head -3; done
