#!/bin/bash
# One H100: the QLoRA one-row step (7B nf4, one packed 4k row, checkpointing) at ZeRO-2 against ZeRO-0,
# alternating, three runs each; the model folder is the one the first call built (same warm machine).
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c2; mkdir -p $C; nvidia-smi -L > $C/gpus.txt
r() { local name=$1 out=$2 t=$3
  timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns; tar czf $OUT/c2.tgz -C /tmp c2
  echo "$out $(grep -h '^| zerolab' $C/$out/benchmark.md | cut -c1-160)"; }
Z2=zerolab-qwen2.5-7b-1gpu-z2-nf4-mb1-ckpt-rep1; Z0=zerolab-qwen2.5-7b-1gpu-z0-nf4-mb1-ckpt
r $Z2 z2a 200; r $Z0 z0a 110; r $Z0 z0b 100; r $Z2 z2b 100; r $Z2 z2c 100
[ $SECONDS -lt 480 ] && r $Z0 z0c $((575-SECONDS))
cat $C/times.txt
