#!/bin/bash
# One GPU: which folded node moves the 7B loss (and what each is worth): 7B LoRA r16, ZeRO-2, two packed 4k rows.
source .whl-bench/env.sh
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/bis; mkdir -p $C; nvidia-smi -L > $C/gpus.txt
r() { local out=$1 t=$2; shift 2
  (env "$@" timeout $t python jobs/benchmark.py --skip-checks --run zerolab-qwen2.5-7b-1gpu-z2-rep2 --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1)
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns; tar czf $OUT/bis.tgz -C /tmp bis
  echo "$out $(grep -h '^| zerolab' $C/$out/benchmark.md | cut -d'|' -f4-8) $(grep -o 'loss [0-9.]*' $C/$out/runs.log | tr '\n' ' ')"; }
r old 250 ZEROLAB_NO_FOLD=1
r single 70 ZEROLAB_FOLD_ONLY=single
r groups_narrow 70 ZEROLAB_FOLD_ONLY=groups_narrow
r groups 70 ZEROLAB_FOLD_ONLY=groups
[ $SECONDS -lt 400 ] && r all 70 X=1
cat $C/times.txt
