#!/bin/bash
# One H100: the LoRA node's two products summed in the base product's epilogue. GPU checks first (the fused LoRA
# forward with the node's Triton kernels against peft's); then 7B bf16 LoRA at two
# packed 4k rows (the trl-7b suite's rows): this tree (new), the tree before (base, HEAD), alternating.
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c4; mkdir -p $C /tmp/base; nvidia-smi -L > $C/gpus.txt
tar xzf .calls/base.tgz -C /tmp/base
NEWPP=$PYTHONPATH; BASEPP=$(echo $PYTHONPATH | sed "s#$(pwd)/platform#/tmp/base/platform#; s#:$(pwd):#:/tmp/base:#")
echo "new $NEWPP / base $BASEPP" >> $C/gpus.txt
timeout 150 python -m pytest -q -rA -p no:cacheprovider -m gpu tests/test_kernels.py \
  -k "fused_lora" > $C/gputest.log 2>&1; echo "gputest rc $? $SECONDS" >> $C/times.txt
r() { local tree=$1 name=$2 out=$3 t=$4 pp=$NEWPP dir=$(pwd)
  [ $tree = base ] && { pp=$BASEPP; dir=/tmp/base; }
  (cd $dir && PYTHONPATH=$pp timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1)
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns; tar czf $OUT/c4.tgz -C /tmp c4
  echo "$out $(grep -h '^| zerolab\|^| trl' $C/$out/benchmark.md | cut -c1-170)"; }
ZL=zerolab-qwen2.5-7b-1gpu-z2-rep1; TRL=trl-qwen2.5-7b-1gpu-z0-rep1
r new $ZL new1 230; r base $ZL base1 80; r new $ZL new2 80; [ $SECONDS -lt 300 ] && r base $ZL base2 $((370-SECONDS))
cat $C/times.txt; grep -E "passed|failed|PASSED|FAILED" $C/gputest.log | tail -16
for d in new1 base1 new2 base2; do cut -d, -f1,5-13 $C/$d/bench_calibration.csv 2>/dev/null | tail -1; done
