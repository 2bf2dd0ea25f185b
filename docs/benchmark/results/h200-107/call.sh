#!/bin/bash
# One GPU: zerolab's step with the folded products (this tree) profiled as h200-104 profiled 825e950's,
# then one run each of 49d856e (base) and this tree for their per-step losses.
source .whl-bench/env.sh
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/pf; mkdir -p $C /tmp/base; nvidia-smi -L > $C/gpus.txt
tar xzf .calls/base.tgz -C /tmp/base
NEWPP=$PYTHONPATH; BASEPP=$(echo $PYTHONPATH | sed "s#$(pwd)/platform#/tmp/base/platform#; s#:$(pwd):#:/tmp/base:#")
r() { local tree=$1 name=$2 out=$3 t=$4 pp=$NEWPP dir=$(pwd)
  [ $tree = base ] && { pp=$BASEPP; dir=/tmp/base; }
  (cd $dir && PYTHONPATH=$pp timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1)
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns; tar czf $OUT/pf.tgz -C /tmp pf
  echo "$out $(grep -h '^| zerolab\|^| trl' $C/$out/benchmark.md | cut -d'|' -f2-9)"; }
r new zerolab-torchrun-qwen2.5-7b-1gpu-z2-profile-mb2 prof 400
grep -h "PROFILE" $C/prof/runs.log | grep -v "PROFILE py\|PROFILE gap" | head -60
[ $SECONDS -lt 420 ] && r base zerolab-qwen2.5-7b-1gpu-z2-rep2 base 70
[ $SECONDS -lt 500 ] && r new zerolab-qwen2.5-7b-1gpu-z2-rep2 new 70
grep -h "step .*loss" $C/base/runs.log | cut -c1-60; grep -h "step .*loss" $C/new/runs.log | cut -c1-60
cat $C/times.txt
