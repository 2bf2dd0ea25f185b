#!/bin/bash
# One GPU: the kernel tests on CUDA (beside the machine's first run, which writes the 7B model), then
# 7B LoRA r16, ZeRO-2, two packed 4k rows, caches warm: the folded products (new, this tree) against
# 49d856e (base), alternating; TRL last where the time allows.
source .whl-bench/env.sh
export MLFLOW_ALLOW_FILE_STORE=true
C=$OUT/fold; mkdir -p $C /tmp/base; nvidia-smi -L > $C/gpus.txt
tar xzf .calls/base.tgz -C /tmp/base
NEWPP=$PYTHONPATH; BASEPP=$(echo $PYTHONPATH | sed "s#$(pwd)/platform#/tmp/base/platform#; s#:$(pwd):#:/tmp/base:#")
(timeout 240 python -m pytest -q -n 0 -p no:cacheprovider tests/test_kernels.py > $C/pytest_kernels.log 2>&1; echo "pytest rc $? $SECONDS" >> $C/times.txt) &
r() { local tree=$1 name=$2 out=$3 t=$4 pp=$NEWPP dir=$(pwd)
  [ $tree = base ] && { pp=$BASEPP; dir=/tmp/base; }
  (cd $dir && PYTHONPATH=$pp timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1)
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns
  echo "$out $(grep -h '^| zerolab\|^| trl' $C/$out/benchmark.md | cut -d'|' -f2-9) $(grep -o 'loss [0-9.]*' $C/$out/runs.log | tail -1)"; }
ZL=zerolab-qwen2.5-7b-1gpu-z2-rep2; TRL=trl-qwen2.5-7b-1gpu-z0-rep2
r new $ZL w 260
wait
tail -3 $C/pytest_kernels.log
for i in 1 2 3; do
  [ $SECONDS -lt 470 ] && r base $ZL base$i 70
  [ $SECONDS -lt 480 ] && r new $ZL new$i 70
done
[ $SECONDS -lt 520 ] && r new $TRL trl1 75
cat $C/times.txt
