#!/bin/bash
# One H100: the held-out check of LLM.int8()'s per-token held bytes (--suite int8-heldout).
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c6; mkdir -p $C; nvidia-smi -L > $C/gpus.txt
timeout 560 python jobs/benchmark.py --skip-checks --suite int8-heldout --out $C/int8 --work /tmp/w0 > $C/int8.log 2>&1
echo "int8 rc $? $SECONDS" >> $C/times.txt; rm -rf $C/int8/mlruns; tar czf $OUT/c6.tgz -C /tmp c6
grep -h '^| zerolab' $C/int8/benchmark.md | cut -c1-200; cut -d, -f1,5-13 $C/int8/bench_calibration.csv; cat $C/times.txt
