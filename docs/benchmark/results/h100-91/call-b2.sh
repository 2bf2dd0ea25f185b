#!/bin/bash
# Same machine, after call-b: the tree before the start-up changes (base, 3ea31e9) and this tree (new), each a
# first launch (empty data and kernel caches of its own), alternating.
source .whl-bench/env.sh
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/pb2; mkdir -p $C /tmp/base; nvidia-smi -L > $C/gpus.txt; ls /tmp/w0/models >> $C/gpus.txt
rm -rf /tmp/base/*; tar xzf .calls/base.tgz -C /tmp/base
NEWPP=$PYTHONPATH; BASEPP=$(echo $PYTHONPATH | sed "s#$(pwd)/platform#/tmp/base/platform#; s#:$(pwd):#:/tmp/base:#")
r() { local tree=$1 name=$2 out=$3 t=$4 pp=$NEWPP dir=$(pwd) env=""
  rm -rf /tmp/fl-$out; env="ZEROLAB_CACHE=/tmp/fl-$out/z TRITON_CACHE_DIR=/tmp/fl-$out/t"
  [ $tree = base ] && { pp=$BASEPP; dir=/tmp/base; }
  (cd $dir && env $env PYTHONPATH=$pp timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1)
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns; tar czf $OUT/pb2.tgz -C /tmp pb2
  echo "$out $(grep -h '^| zerolab\|^| trl' $C/$out/benchmark.md | cut -c1-170)"; }
ZL=zerolab-qwen2.5-7b-1gpu-z2-rep1
r base $ZL base1 250; r new $ZL new4 100; r base $ZL base2 100; [ $SECONDS -lt 330 ] && r new $ZL new5 100
cat $C/times.txt
for d in base1 new4 base2 new5; do grep -h "start-up:" $C/$d/runs.log | cut -c1-330; done
