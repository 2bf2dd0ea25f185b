#!/bin/bash
# The longest row over two GPUs with sequence parallelism (issue 40): 7B, LoRA r16, checkpointing, one row
# split over both GPUs at the length the memory estimate names for this host, ZeRO-2 then ZeRO-3.
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c1; mkdir -p $C; nvidia-smi -L > $C/gpus.txt; free -g | head -2 >> $C/gpus.txt
r() { local name=$1 out=$2 t=$3
  [ $t -lt 120 ] && { echo "$out not started ($t s left)" >> $C/times.txt; return; }
  timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1
  echo "$out rc $? $SECONDS" >> $C/times.txt; }
r zerolab-qwen2.5-7b-2gpu-z2-sp2-rowsmax-ckpt z2 330
r zerolab-qwen2.5-7b-2gpu-z3-sp2-rowsmax-ckpt z3 $((580-SECONDS))
rm -rf $C/*/mlruns; tar czf $OUT/c1.tgz -C /tmp c1; cat $C/gpus.txt $C/times.txt
for d in z2 z3; do grep -h "rows of\|rc\|Error\|error" $C/$d.log | tail -3; grep -h '^| zerolab' $C/$d/benchmark.md | cut -c1-200; cut -d, -f1,5-13 $C/$d/bench_calibration.csv | tail -1; done
