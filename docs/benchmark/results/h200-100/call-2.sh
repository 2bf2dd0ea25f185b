#!/bin/bash
# Same machine after c1: the one-GPU test tier, then TRL and one more pair.
source .whl-bench/env.sh
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/si2; mkdir -p $C
(ZEROLAB_COMMIT=$(cat .calls/commit) timeout 420 python -m pytest -m gpu -n 4 -q -p no:cacheprovider --junitxml=$C/gpu.xml > $C/gpu.log 2>&1; echo "gpu tier rc $? $SECONDS" >> $C/times.txt)
tail -25 $C/gpu.log; cp $C/gpu.xml $OUT/ 2>/dev/null
NEWPP=$PYTHONPATH; BASEPP=$(echo $PYTHONPATH | sed "s#$(pwd)/platform#/tmp/base/platform#; s#:$(pwd):#:/tmp/base:#")
r() { local tree=$1 name=$2 out=$3 t=$4 pp=$NEWPP dir=$(pwd)
  [ $tree = base ] && { pp=$BASEPP; dir=/tmp/base; }
  (cd $dir && PYTHONPATH=$pp timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1)
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns; tar czf $OUT/si2.tgz -C /tmp si2
  echo "$out $(grep -h '^| zerolab\|^| trl' $C/$out/benchmark.md | cut -c1-170)"; }
ZL=zerolab-qwen2.5-7b-1gpu-z2-rep2; TRL=trl-qwen2.5-7b-1gpu-z0-rep2
[ $SECONDS -lt 470 ] && r new $ZL new4 60
[ $SECONDS -lt 520 ] && r base $ZL base4 60
cat $C/times.txt
