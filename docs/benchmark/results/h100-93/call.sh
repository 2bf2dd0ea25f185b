#!/bin/bash
# One H100: first launches (empty data and kernel caches of their own) of this tree (new) and of the tree before
# this stop's start-up changes (base, 3ea31e9), alternating, and TRL's first launch; 7B at two packed 4k rows.
source .whl-bench/env.sh
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/pc; mkdir -p $C /tmp/base; nvidia-smi -L > $C/gpus.txt
tar xzf .calls/base.tgz -C /tmp/base
NEWPP=$PYTHONPATH; BASEPP=$(echo $PYTHONPATH | sed "s#$(pwd)/platform#/tmp/base/platform#; s#:$(pwd):#:/tmp/base:#")
r() { local tree=$1 name=$2 out=$3 t=$4 pp=$NEWPP dir=$(pwd) env=""
  rm -rf /tmp/fl-$out; env="ZEROLAB_CACHE=/tmp/fl-$out/z TRITON_CACHE_DIR=/tmp/fl-$out/t"
  [ $tree = base ] && { pp=$BASEPP; dir=/tmp/base; }
  (cd $dir && env $env PYTHONPATH=$pp timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1)
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns; tar czf $OUT/pc.tgz -C /tmp pc
  echo "$out $(grep -h '^| zerolab\|^| trl' $C/$out/benchmark.md | cut -c1-170)"; }
ZL=zerolab-qwen2.5-7b-1gpu-z2-rep1; TRL=trl-qwen2.5-7b-1gpu-z0-rep1
r new $ZL new1 230; r new $TRL trl1 80; r base $ZL base1 75; r new $ZL new2 75; r base $ZL base2 75
[ $SECONDS -lt 330 ] && r new $TRL trl2 75
cat $C/times.txt
for d in new1 base1 new2 base2; do grep -h "start-up:\|worker ready" $C/$d/runs.log | cut -c1-330; done
