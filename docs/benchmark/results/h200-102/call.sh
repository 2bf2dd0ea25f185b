#!/bin/bash
# One GPU: 7B LoRA r16, ZeRO-2, two packed 4k rows, caches warm: this tree (new) against the main the
# issue was filed on (base, 1d3c324; its own harness and run of the same settings), alternating; TRL beside them.
source .whl-bench/env.sh
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/m7; mkdir -p $C /tmp/base; nvidia-smi -L > $C/gpus.txt
tar xzf .calls/base.tgz -C /tmp/base
NEWPP=$PYTHONPATH; BASEPP=$(echo $PYTHONPATH | sed "s#$(pwd)/platform#/tmp/base/platform#; s#:$(pwd):#:/tmp/base:#")
r() { local tree=$1 name=$2 out=$3 t=$4 pp=$NEWPP dir=$(pwd)
  [ $tree = base ] && { pp=$BASEPP; dir=/tmp/base; }
  (cd $dir && PYTHONPATH=$pp timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1)
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns; tar czf $OUT/m7.tgz -C /tmp m7
  echo "$out $(grep -h '^| zerolab\|^| trl' $C/$out/benchmark.md | cut -c1-170)"; }
ZL=zerolab-qwen2.5-7b-1gpu-z2-rep2; BZL=zerolab-qwen2.5-7b-1gpu-z2-mb2; TRL=trl-qwen2.5-7b-1gpu-z0-rep2
r new $ZL w 250
for i in 1 2 3; do
  [ $SECONDS -lt 520 ] && r base $BZL base$i 75
  [ $SECONDS -lt 520 ] && r new $ZL new$i 75
  [ $SECONDS -lt 510 ] && r new $TRL trl$i 75
done
cat $C/times.txt
