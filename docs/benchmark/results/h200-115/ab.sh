#!/bin/bash
# One GPU: 7B LoRA r16, ZeRO-2, two packed 4k rows, caches warm. Trees: new (this tree), mof (1d3c324,
# the main the issue was filed on, with its own harness and run of the same settings), par (364f907,
# this tree before the head ran over target rows only). Usage: ab.sh <label> <limit_s> <tree:run:out>...
source .whl-bench/env.sh
export MLFLOW_ALLOW_FILE_STORE=true
L=$1; END=$2; shift 2; : ${T0:=$(date +%s)}; el() { echo $(( $(date +%s) - T0 )); }
C=/tmp/$L; mkdir -p $C; nvidia-smi -L > $C/gpus.txt
for t in mof par hb; do [ -d /tmp/$t ] || { mkdir -p /tmp/$t; tar xzf .calls/$t.tgz -C /tmp/$t; }; done
NEWPP=$PYTHONPATH
pp_of() { echo $NEWPP | sed "s#$(pwd)/platform#/tmp/$1/platform#; s#:$(pwd):#:/tmp/$1:#"; }
declare -A RUN=([new]=zerolab-qwen2.5-7b-1gpu-z2-rep2 [par]=zerolab-qwen2.5-7b-1gpu-z2-rep2 [hb]=zerolab-qwen2.5-7b-1gpu-z2-rep2 [mof]=zerolab-qwen2.5-7b-1gpu-z2-mb2 [trl]=trl-qwen2.5-7b-1gpu-z0-rep2)
for spec in "$@"; do
  IFS=: read tree out t <<< "$spec"
  [ $(( $(el) + t)) -gt $END ] && { echo "$out skipped $(el)" >> $C/times.txt; continue; }
  pp=$NEWPP dir=$(pwd)
  case $tree in mof|par|hb) pp=$(pp_of $tree); dir=/tmp/$tree;; esac
  (cd $dir && PYTHONPATH=$pp timeout $t python jobs/benchmark.py --skip-checks --run ${RUN[$tree]} --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1)
  echo "$out rc $? $(el)" >> $C/times.txt; rm -rf $C/$out/mlruns; tar czf $OUT/$L.tgz -C /tmp $L
  echo "$out $(grep -h '^| zerolab\|^| trl' $C/$out/benchmark.md 2>/dev/null | cut -c1-170)"
done
cat $C/times.txt
