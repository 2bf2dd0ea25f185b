#!/bin/bash
# One H100: 7B at 32K with the tiled MLP (the long-row MFU target); each copied out when done.
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c4; mkdir -p $C; nvidia-smi -L > $C/gpus.txt
r() { local name=$1 out=$2 t=$3
  timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns; tar czf $OUT/c4-$out.tgz -C /tmp c4/$out c4/$out.log c4/times.txt c4/gpus.txt
  grep -h '^| zerolab' $C/$out/benchmark.md | cut -c1-170; grep -h "mfu_attn\|^zerolab" $C/$out/benchmark.csv | cut -c1-400; }

r zerolab-qwen2.5-7b-1gpu-z2-rows32k-tiled 32k 205
cat $C/times.txt
