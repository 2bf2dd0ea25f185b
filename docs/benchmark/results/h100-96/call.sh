#!/bin/bash
# One H100: ZeRO-3 against ZeRO-2 at one packed 4k row, 7B: through the job (ZeRO-2, then ZeRO-3 with leaf
# layers, the default), then the same step under torchrun, profiled (--suite zero3-profile-7b), then the job pair again.
source .whl-bench/env.sh
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/z3; mkdir -p $C; nvidia-smi -L > $C/gpus.txt
r() { local name=$1 out=$2 t=$3
  timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns; tar czf $OUT/z3.tgz -C /tmp z3
  echo "$out $(grep -h '^| zerolab' $C/$out/benchmark.md | cut -c1-170)"; }
r zerolab-qwen2.5-7b-1gpu-z2 z2job1 300
r zerolab-qwen2.5-7b-1gpu-z3-leaf z3job1 150
timeout 330 python jobs/benchmark.py --skip-checks --suite zero3-profile-7b --out $C/prof --work /tmp/w0 > $C/prof.log 2>&1
echo "prof rc $? $SECONDS" >> $C/times.txt; rm -rf $C/prof/mlruns; tar czf $OUT/z3.tgz -C /tmp z3
grep -h '^| zerolab' $C/prof/benchmark.md | cut -c1-170
[ $SECONDS -lt 470 ] && r zerolab-qwen2.5-7b-1gpu-z3-leaf z3job2 120
cat $C/times.txt
