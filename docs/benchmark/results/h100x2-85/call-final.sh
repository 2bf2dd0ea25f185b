#!/bin/bash
# Held-out checks on two GPUs, each predicted before it runs by the code that runs it: set L's ZeRO-2 full
# fine-tuning case (the reduction stream's pool), set N's 7B nf4 8k row (ZeRO-3's reuse scan, the flat
# gather buffers, the released layers per doubling), then ZeRO-3's longest row over both GPUs in two steps.
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c5; mkdir -p $C; nvidia-smi -L > $C/gpus.txt
h() { local cases=$1 only=$2 out=$3 t=$4
  [ $t -lt 60 ] && { echo "$out not started ($t s left)" >> $C/times.txt; return; }
  timeout $t python bench/calibrate_memory.py --held-out --cases $cases --only $only --models /tmp/w0/models --out $C/$out > $C/$out.log 2>&1
  echo "$out rc $? $SECONDS" >> $C/times.txt; }
h held-out-l-2gpu full-z2 set-l 150
h held-out-n b1x8192 set-n $((330-SECONDS))
t=$((585-SECONDS))
timeout $t python jobs/benchmark.py --skip-checks --run zerolab-qwen2.5-7b-2gpu-z3-sp2-rowsmax-ckpt --out $C/z3 --work /tmp/w0 > $C/z3.log 2>&1
echo "z3 rc $? $SECONDS" >> $C/times.txt
rm -rf $C/*/mlruns $C/*/runs $C/*/models; tar czf $OUT/c5.tgz -C /tmp c5; cat $C/gpus.txt $C/times.txt
for d in set-l set-n; do grep -h "^| qwen" $C/$d/memory_heldout.md | cut -c1-220; done
grep -h "rows of" $C/z3.log; grep -h '^| zerolab' $C/z3/benchmark.md | cut -c1-200; cut -d, -f1,5-13 $C/z3/bench_calibration.csv | tail -1
