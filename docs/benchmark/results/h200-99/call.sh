#!/bin/bash
# One GPU, the final tree (checkpoints released as DeepSpeed does): 7B, one packed 4k row, ZeRO-3 new against base (9ef0aeb) and ZeRO-2, alternating.
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/z3r; mkdir -p $C /tmp/base; nvidia-smi -L > $C/gpus.txt
tar xzf .calls/base.tgz -C /tmp/base
NEWPP=$PYTHONPATH; BASEPP=$(echo $PYTHONPATH | sed "s#$(pwd)/platform#/tmp/base/platform#; s#:$(pwd):#:/tmp/base:#")
r() { local tree=$1 name=$2 out=$3 t=$4 pp=$NEWPP dir=$(pwd)
  [ $tree = base ] && { pp=$BASEPP; dir=/tmp/base; }
  (cd $dir && PYTHONPATH=$pp timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1)
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns; tar czf $OUT/z3r.tgz -C /tmp z3r
  echo "$out $(grep -h '^| zerolab' $C/$out/benchmark.md | cut -c1-170)"; }
Z2=zerolab-qwen2.5-7b-1gpu-z2; Z3=zerolab-qwen2.5-7b-1gpu-z3-leaf
r new $Z2 z2w 280
for i in 1 2 3; do
  [ $SECONDS -lt 420 ] && r new $Z3 z3new$i 75
  [ $SECONDS -lt 450 ] && r base $Z3 z3base$i 75
  [ $SECONDS -lt 480 ] && r new $Z2 z2new$i 60
done
cat $C/times.txt
grep -h "one rank" $C/z3new1/runs.log | head -2
