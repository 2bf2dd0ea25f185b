#!/bin/bash
# One GPU: zerolab's step (under torchrun) and TRL's, 7B, two packed 4k rows, profiled in one lease.
source .whl-bench/env.sh
export MLFLOW_ALLOW_FILE_STORE=true
nvidia-smi -L > $OUT/gpus.txt
timeout 540 python jobs/benchmark.py --skip-checks --suite trl-profile-7b --out $OUT/prof --work /tmp/w0 > $OUT/prof.log 2>&1
echo rc $? $SECONDS
rm -rf $OUT/prof/mlruns
grep -h "PROFILE" $OUT/prof/runs.log | grep -v "PROFILE py\|PROFILE gap" | head -120
grep -h "^| zerolab\|^| trl" $OUT/prof/benchmark.md
