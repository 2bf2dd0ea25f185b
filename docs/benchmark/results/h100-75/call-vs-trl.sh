#!/bin/bash
# The same warm H100 after c3: this tree's QLoRA one-row step against TRL's, alternating, three runs each.
source .whl-bench/env.sh
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c4; mkdir -p $C; nvidia-smi -L > $C/gpus.txt
r() { local name=$1 out=$2 t=$3
  timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns; tar czf $OUT/c4.tgz -C /tmp c4
  echo "$out $(grep -h '^| zerolab\|^| trl' $C/$out/benchmark.md | cut -c1-150)"; }
ZL=zerolab-qwen2.5-7b-1gpu-z2-nf4-mb1-ckpt-rep1; TRL=trl-qwen2.5-7b-1gpu-z0-nf4-mb1-ckpt-rep1
r $TRL trl1 150; r $ZL zl1 100; r $ZL zl2 100; r $TRL trl2 120; [ $SECONDS -lt 420 ] && r $TRL trl3 120
[ $SECONDS -lt 480 ] && r $ZL zl3 $((575-SECONDS))
cat $C/times.txt
