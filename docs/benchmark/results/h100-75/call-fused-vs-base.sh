#!/bin/bash
# One H100: the fused LoRA node on a 4-bit base. GPU test first; then the QLoRA one-row step (7B nf4, one packed
# 4k row, checkpointing): this tree (new), TRL and the tree before the change (base, ae03777), alternating.
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c3; mkdir -p $C /tmp/base; nvidia-smi -L > $C/gpus.txt
tar xzf .lease/s50/base-ae03777.tgz -C /tmp/base
NEWPP=$PYTHONPATH; BASEPP=$(echo $PYTHONPATH | sed "s#$(pwd)/platform#/tmp/base/platform#; s#:$(pwd):#:/tmp/base:#")
echo "new $NEWPP / base $BASEPP" >> $C/gpus.txt
timeout 120 python -m pytest -q -p no:cacheprovider -m gpu tests/test_quantization.py -k fused_lora > $C/gputest.log 2>&1; echo "gputest rc $? $SECONDS" >> $C/times.txt
r() { local tree=$1 name=$2 out=$3 t=$4 pp=$NEWPP dir=$(pwd)
  [ $tree = base ] && { pp=$BASEPP; dir=/tmp/base; }
  (cd $dir && PYTHONPATH=$pp timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1)
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns; tar czf $OUT/c3.tgz -C /tmp c3
  echo "$out $(grep -h '^| zerolab\|^| trl' $C/$out/benchmark.md | cut -c1-150)"; }
ZL=zerolab-qwen2.5-7b-1gpu-z2-nf4-mb1-ckpt-rep1; TRL=trl-qwen2.5-7b-1gpu-z0-nf4-mb1-ckpt-rep1
r new $ZL new1 220; r base $ZL base1 100; r new $ZL new2 100; [ $SECONDS -lt 400 ] && r base $ZL base2 100
[ $SECONDS -lt 420 ] && r new $ZL new3 100; [ $SECONDS -lt 480 ] && r base $ZL base3 $((575-SECONDS))
cat $C/times.txt; tail -3 $C/gputest.log
