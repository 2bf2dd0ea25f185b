#!/bin/bash
# Who imports TorchInductor in a one-GPU job (the built-in tiny model, Liger, varlen), and the worker's set-up phases.
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/ph; mkdir -p $C
for i in 1 2; do
HOOK_OUT=$C/stack$i.txt PYTHONPATH=$(pwd)/.calls/hook:$PYTHONPATH timeout 120 python jobs/sft.py --set run.storage_path=/tmp/hr$i \
  --set tracking.uri=file:///tmp/hr$i/mlruns --set scaling.use_gpu=true --set scaling.num_workers=1 --set train.max_steps=4 \
  --set model.attn_implementation=varlen --set model.kernels=auto > $C/log$i.txt 2>&1; echo "rc $? $SECONDS" >> $C/log$i.txt
done
tar czf $OUT/ph.tgz -C /tmp ph
grep -h "worker ready\|start-up:" $C/log*.txt | cut -c1-300; grep -h "=====" $C/stack*.txt
