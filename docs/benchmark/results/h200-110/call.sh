#!/bin/bash
# One GPU: the lora-nodes-7b suite (every step's loss: nodes, peft's forward, nodes without overlap_comm),
# after the GPU tier's new engine test (kernels auto against none at the tier's shape).
source .whl-bench/env.sh
export MLFLOW_ALLOW_FILE_STORE=true
C=$OUT/ln; mkdir -p $C; nvidia-smi -L > $C/gpus.txt
timeout 180 python -m pytest -q -n 0 -p no:cacheprovider "tests/test_gpu_tier.py::test_the_lora_nodes_train_as_peft_in_a_one_gpu_job" > $C/pytest_nodes.log 2>&1; echo "pytest rc $? $SECONDS" >> $C/times.txt
timeout $((570-SECONDS)) python jobs/benchmark.py --skip-checks --suite lora-nodes-7b --out $C/suite --work /tmp/w0 > $C/suite.log 2>&1
echo "suite rc $? $SECONDS" >> $C/times.txt
for d in $(find $C/suite /tmp/w0 -maxdepth 2 -name mlruns -type d); do python .calls/dump_losses.py file://$d >> $C/losses.txt 2>&1; done
find $C/suite -name mlruns -prune -exec rm -rf {} \;
cat $C/losses.txt
cat $C/times.txt; tail -5 $C/pytest_nodes.log
grep -h '^| zerolab' $C/suite/benchmark.md | cut -d'|' -f2-9
