#!/bin/bash
# One H100: issue 38's two long-row figures (7B 256K rows with offload and the tiled MLP; 0.5B at 64K rows).
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c1; mkdir -p $C; nvidia-smi -L > $C/gpus.txt
r() { local name=$1 out=$2 t=$3
  timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns; tar czf $OUT/c1-$out.tgz -C /tmp c1/$out c1/$out.log c1/times.txt c1/gpus.txt
  grep -h '^| zerolab' $C/$out/benchmark.md | cut -c1-200; }
r zerolab-qwen2.5-7b-1gpu-z2-rows256k-ckpt-offload-tiled 256k 420
r zerolab-qwen2.5-0.5b-1gpu-z2-rows64k 64k $((575-SECONDS))
cat $C/times.txt; free -g | head -2
