#!/bin/bash
# One GPU: the frozen products' kernels (gate/up and Q/K/V stacked against apart), then 7B
# LoRA r16, ZeRO-2, two packed 4k rows, alternating: the nodes as shipped (a), overlap_comm off (b);
# the main of issue 39's filing (1d3c324) last where time allows.
source .whl-bench/env.sh
export MLFLOW_ALLOW_FILE_STORE=true
C=$OUT/ab; mkdir -p $C /tmp/base; nvidia-smi -L > $C/gpus.txt
timeout 120 python .calls/gemm2.py > $C/gemm.txt 2>&1; echo "gemm rc $? $SECONDS" >> $C/times.txt
tar xzf .calls/base.tgz -C /tmp/base
NEWPP=$PYTHONPATH; BASEPP=$(echo $PYTHONPATH | sed "s#$(pwd)/platform#/tmp/base/platform#; s#:$(pwd):#:/tmp/base:#")
r() { local kind=$1 name=$2 out=$3 T=${4:-80} pp=$NEWPP dir=$(pwd) x=
  [ $kind = base ] && { pp=$BASEPP; dir=/tmp/base; }
  [ $kind = lt ] && { pp=$(pwd)/.calls/blaslt:$NEWPP; x=1; }
  (cd $dir && X_BLASLT=$x PYTHONPATH=$pp timeout $T python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1)
  echo "$out rc $? $SECONDS" >> $C/times.txt
  echo "$out $(grep -h '^| zerolab' $C/$out/benchmark.md | cut -d'|' -f2-9)" | tee -a $C/summary.txt; }
N=zerolab-qwen2.5-7b-1gpu-z2-nodes
r new $N a1 280
[ $SECONDS -lt 380 ] && r new $N-no-overlap b1
for i in 2 3; do
  [ $SECONDS -lt 400 ] && r new $N a$i
  [ $SECONDS -lt 420 ] && r new $N-no-overlap b$i
done
[ $SECONDS -lt 440 ] && r base zerolab-qwen2.5-7b-1gpu-z2-mb2 base1
python .calls/dump_losses.py file:///tmp/w0/mlruns > $C/losses.txt 2>&1
cat $C/gemm.txt; cat $C/times.txt; cat $C/summary.txt
grep -h "train/loss" $C/losses.txt | awk '{print $1, $NF}'
