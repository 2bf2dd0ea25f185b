#!/bin/bash
# One H100: first launches (empty data and Triton caches of their own) of this tree (new: the first step's
# kernels compiled ahead), the tree before it (base, c7c8428) and TRL, alternating; each new run's Triton
# cache listed with times (what the compiling process wrote, and anything the job compiled after it).
source .whl-bench/env.sh
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/ka; mkdir -p $C /tmp/base; nvidia-smi -L > $C/gpus.txt
D=$(python -c 'import torch,os;print(os.path.dirname(torch.__file__))'); ls $D/_dynamo/__pycache__ 2>&1 | head -2 >> $C/gpus.txt
rm -rf /tmp/base/*; tar xzf .calls/base.tgz -C /tmp/base
NEWPP=$PYTHONPATH; BASEPP=$(echo $PYTHONPATH | sed "s#$(pwd)/platform#/tmp/base/platform#; s#:$(pwd):#:/tmp/base:#")
r() { local tree=$1 name=$2 out=$3 t=$4 pp=$NEWPP dir=$(pwd) env=""
  rm -rf /tmp/fl-$out; env="ZEROLAB_CACHE=/tmp/fl-$out/z TRITON_CACHE_DIR=/tmp/fl-$out/t"
  [ $tree = base ] && { pp=$BASEPP; dir=/tmp/base; }
  (cd $dir && env $env PYTHONPATH=$pp timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1)
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns
  find /tmp/fl-$out/t -name '*.json' ! -name '__grp__*' -printf '%TT %f\n' 2>/dev/null | sort > $C/$out/triton-cache.txt
  tar czf $OUT/ka.tgz -C /tmp ka
  echo "$out $(grep -h '^| zerolab\|^| trl' $C/$out/benchmark.md | cut -c1-170)"; }
ZL=zerolab-qwen2.5-7b-1gpu-z2-rep; TRL=trl-qwen2.5-7b-1gpu-z0-rep
r new ${ZL}1 new1 280; r base ${ZL}1 base1 110; r new ${TRL}1 trl1 110; r new ${ZL}1 new2 100; r base ${ZL}1 base2 100
cat $C/times.txt
for d in new1 base1 new2 base2; do grep -h "start-up:\|kernels_ahead\|worker ready" $C/$d/runs.log | cut -c1-330; done
for d in new1 new2; do echo "== $d"; cat $C/$d/triton-cache.txt; done
