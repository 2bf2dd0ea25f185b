#!/bin/bash
# One H100: issue 38's 4k, 32K and 128K tokens/s in one lease (7B shape, one GPU).
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c5; mkdir -p $C; nvidia-smi -L > $C/gpus.txt
r() { local name=$1 out=$2 t=$3
  timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns; tar czf $OUT/c5.tgz -C /tmp c5
  grep -h '^| zerolab' $C/$out/benchmark.md | cut -c1-200; }
r zerolab-qwen2.5-7b-1gpu-z2-rows4k 4k 200
r zerolab-qwen2.5-7b-1gpu-z2-rows32k-tiled 32k 150
r zerolab-qwen2.5-7b-1gpu-z2-rows128k-ckpt 128k $((578-SECONDS))
cat $C/times.txt
