#!/bin/bash
# One GPU: 7B LoRA r16, ZeRO-2, two packed 4k rows, caches warm: the base product first and the adapter's
# accumulating onto it (new) against the adapter's first and the base product's epilogue sum (base, 825e950), alternating.
source .whl-bench/env.sh
export MLFLOW_ALLOW_FILE_STORE=true
C=$OUT/bo; mkdir -p $C /tmp/base; nvidia-smi -L > $C/gpus.txt
tar xzf .calls/base.tgz -C /tmp/base
NEWPP=$PYTHONPATH; BASEPP=$(echo $PYTHONPATH | sed "s#$(pwd)/platform#/tmp/base/platform#; s#:$(pwd):#:/tmp/base:#")
r() { local tree=$1 out=$2 t=$3 pp=$NEWPP dir=$(pwd)
  [ $tree = base ] && { pp=$BASEPP; dir=/tmp/base; }
  (cd $dir && PYTHONPATH=$pp timeout $t python jobs/benchmark.py --skip-checks --run zerolab-qwen2.5-7b-1gpu-z2-rep2 --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1)
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns
  echo "$out $(grep -h '^| zerolab' $C/$out/benchmark.md | cut -d'|' -f4-8) $(grep -o 'loss [0-9.]*' $C/$out/runs.log | tail -1)"; }
r new new1 200
[ $SECONDS -lt 200 ] && r base base1 60
[ $SECONDS -lt 215 ] && r new new2 60
[ $SECONDS -lt 255 ] && r base base2 60
cat $C/times.txt
