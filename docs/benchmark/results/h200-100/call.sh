#!/bin/bash
# One GPU: 7B LoRA r16, ZeRO-2, two packed 4k rows (the trl-7b suite's zerolab run, caches warm), the shared-input
# node (new) against the tree before it (base, b5fe250), alternating; TRL beside them.
source .whl-bench/env.sh
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/si; mkdir -p $C /tmp/base; nvidia-smi -L > $C/gpus.txt
tar xzf .calls/base.tgz -C /tmp/base
NEWPP=$PYTHONPATH; BASEPP=$(echo $PYTHONPATH | sed "s#$(pwd)/platform#/tmp/base/platform#; s#:$(pwd):#:/tmp/base:#")
r() { local tree=$1 name=$2 out=$3 t=$4 pp=$NEWPP dir=$(pwd)
  [ $tree = base ] && { pp=$BASEPP; dir=/tmp/base; }
  (cd $dir && PYTHONPATH=$pp timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1)
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns; tar czf $OUT/si.tgz -C /tmp si
  echo "$out $(grep -h '^| zerolab\|^| trl' $C/$out/benchmark.md | cut -c1-170)"; }
ZL=zerolab-qwen2.5-7b-1gpu-z2-rep2; TRL=trl-qwen2.5-7b-1gpu-z0-rep2
r new $ZL w 250
for i in 1 2 3; do
  [ $SECONDS -lt 500 ] && r new $ZL new$i 80
  [ $SECONDS -lt 510 ] && r base $ZL base$i 80
  [ $i -lt 3 ] && [ $SECONDS -lt 480 ] && r new $TRL trl$i 80
done
cat $C/times.txt
grep -h "share an input" $C/new1/runs.log | head -1
