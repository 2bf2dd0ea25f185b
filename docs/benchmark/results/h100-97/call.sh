#!/bin/bash
# One H100: ZeRO-3 (leaf layers, the default) against ZeRO-2 at one packed 4k row through the job, 7B,
# alternating (z3, z2, z3, z2, z3): medians in one lease.
source .whl-bench/env.sh
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/z3m; mkdir -p $C; nvidia-smi -L > $C/gpus.txt
r() { local name=$1 out=$2 t=$3
  timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns; tar czf $OUT/z3m.tgz -C /tmp z3m
  echo "$out $(grep -h '^| zerolab' $C/$out/benchmark.md | cut -c1-170)"; }
Z2=zerolab-qwen2.5-7b-1gpu-z2; Z3=zerolab-qwen2.5-7b-1gpu-z3-leaf
r $Z3 z3a 260; r $Z2 z2a 70; r $Z3 z3b 70; r $Z2 z2b 70; [ $SECONDS -lt 330 ] && r $Z3 z3c 70
cat $C/times.txt
