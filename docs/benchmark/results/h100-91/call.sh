#!/bin/bash
# One H100: the trl-7b suite (zerolab and TRL alternating, three runs each; the first pair first launches with
# empty data and kernel caches of their own), and the tree before the start-up changes (base, 3ea31e9) as a first
# launch the same way, twice.
source .whl-bench/env.sh
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/pb; mkdir -p $C /tmp/base; nvidia-smi -L > $C/gpus.txt
tar xzf .calls/base.tgz -C /tmp/base
NEWPP=$PYTHONPATH; BASEPP=$(echo $PYTHONPATH | sed "s#$(pwd)/platform#/tmp/base/platform#; s#:$(pwd):#:/tmp/base:#")
r() { local tree=$1 name=$2 out=$3 t=$4 pp=$NEWPP dir=$(pwd) env=""
  [ $tree = base ] && { pp=$BASEPP; dir=/tmp/base; rm -rf /tmp/fl-$out; env="ZEROLAB_CACHE=/tmp/fl-$out/z TRITON_CACHE_DIR=/tmp/fl-$out/t"; }
  (cd $dir && env $env PYTHONPATH=$pp timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1)
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns; tar czf $OUT/pb.tgz -C /tmp pb
  echo "$out $(grep -h '^| zerolab\|^| trl' $C/$out/benchmark.md | cut -c1-170)"; }
ZL=zerolab-qwen2.5-7b-1gpu-z2-rep; TRL=trl-qwen2.5-7b-1gpu-z0-rep
r new ${ZL}1 new1 250; r new ${TRL}1 trl1 110; r base ${ZL}1 base1 110
r new ${ZL}2 new2 100; r new ${TRL}2 trl2 100; r new ${ZL}3 new3 100; r new ${TRL}3 trl3 100
[ $SECONDS -lt 500 ] && r base ${ZL}1 base2 $((585-SECONDS))
cat $C/times.txt
for d in new1 base1 new2 new3 base2; do grep -h "start-up:" $C/$d/runs.log | cut -c1-330; done
