#!/bin/bash
# One GPU, a workload the ZeRO-3 change was not measured on first: the 0.5B shape at four packed 4k rows per step,
# ZeRO-3 with leaf layers and per-module (noleaf), new tree against base (HEAD 9ef0aeb), ZeRO-2 alternating.
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/z3q; mkdir -p $C /tmp/base; nvidia-smi -L > $C/gpus.txt
tar xzf .calls/base.tgz -C /tmp/base
NEWPP=$PYTHONPATH; BASEPP=$(echo $PYTHONPATH | sed "s#$(pwd)/platform#/tmp/base/platform#; s#:$(pwd):#:/tmp/base:#")
r() { local tree=$1 name=$2 out=$3 t=$4 pp=$NEWPP dir=$(pwd)
  [ $tree = base ] && { pp=$BASEPP; dir=/tmp/base; }
  (cd $dir && PYTHONPATH=$pp timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1)
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns; tar czf $OUT/z3q.tgz -C /tmp z3q
  echo "$out $(grep -h '^| zerolab' $C/$out/benchmark.md | cut -c1-170)"; }
Z2=zerolab-qwen2.5-0.5b-1gpu-z2; Z3=zerolab-qwen2.5-0.5b-1gpu-z3-leaf; Z3N=zerolab-qwen2.5-0.5b-1gpu-z3-noleaf
r new $Z2 z2w 200
for i in 1 2 3; do
  [ $SECONDS -lt 480 ] && r new $Z3 z3new$i 60
  [ $SECONDS -lt 500 ] && r base $Z3 z3base$i 60
  [ $SECONDS -lt 520 ] && r new $Z2 z2new$i 50
  [ $i -lt 3 ] && [ $SECONDS -lt 500 ] && r new $Z3N z3nnew$i 60
  [ $i -lt 3 ] && [ $SECONDS -lt 520 ] && r base $Z3N z3nbase$i 60
done
cat $C/times.txt
