#!/bin/bash
# One GPU: the frozen products' kernels (plain against accumulating, cuBLAS against cuBLASLt), then 7B
# LoRA r16, ZeRO-2, two packed 4k rows, alternating: the nodes as shipped (a), overlap_comm off (b),
# cuBLASLt preferred (c); the main of issue 39's filing (1d3c324) last where time allows.
source .whl-bench/env.sh
export MLFLOW_ALLOW_FILE_STORE=true
C=$OUT/ab; mkdir -p $C /tmp/base; nvidia-smi -L > $C/gpus.txt
timeout 120 python .calls/gemm_bench.py > $C/gemm.txt 2>&1; echo "gemm rc $? $SECONDS" >> $C/times.txt
tar xzf .calls/base.tgz -C /tmp/base
NEWPP=$PYTHONPATH; BASEPP=$(echo $PYTHONPATH | sed "s#$(pwd)/platform#/tmp/base/platform#; s#:$(pwd):#:/tmp/base:#")
r() { local kind=$1 name=$2 out=$3 pp=$NEWPP dir=$(pwd) x=
  [ $kind = base ] && { pp=$BASEPP; dir=/tmp/base; }
  [ $kind = lt ] && { pp=$(pwd)/.calls/blaslt:$NEWPP; x=1; }
  (cd $dir && X_BLASLT=$x PYTHONPATH=$pp timeout 80 python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1)
  echo "$out rc $? $SECONDS" >> $C/times.txt
  echo "$out $(grep -h '^| zerolab' $C/$out/benchmark.md | cut -d'|' -f2-9)" | tee -a $C/summary.txt; }
N=zerolab-qwen2.5-7b-1gpu-z2-nodes
for i in 1 2 3; do
  [ $SECONDS -lt 470 ] && r new $N a$i
  [ $SECONDS -lt 480 ] && r new $N-no-overlap b$i
  [ $SECONDS -lt 490 ] && r lt $N c$i
done
[ $SECONDS -lt 500 ] && r base zerolab-qwen2.5-7b-1gpu-z2-mb2 base1
python .calls/dump_losses.py file:///tmp/w0/mlruns > $C/losses.txt 2>&1
cat $C/gemm.txt; cat /tmp/blaslt.txt | sort | uniq -c | head -5 > $C/blaslt_procs.txt; cat $C/blaslt_procs.txt; cat $C/times.txt
grep -h "train/loss" $C/losses.txt | awk '{print $1, $NF}'
