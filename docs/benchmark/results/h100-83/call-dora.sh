#!/bin/bash
# The held-out DoRA ZeRO-0 case under by 5.2% on reserved, with its allocator history written up.
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c4; mkdir -p $C; nvidia-smi -L > $C/gpus.txt; git rev-parse HEAD >> $C/gpus.txt
timeout 400 python bench/calibrate_memory.py --held-out --cases held-out-1 --only dora-z0-1gpu-b2x2048 --memory-trace --out $C/cal > $C/cal.log 2>&1
echo "rc $? $SECONDS" >> $C/times.txt
cp $C/cal/traces/*rank0.json.gz $OUT/dora.rank0.json.gz; rm -f $C/cal/traces/*.json.gz; rm -rf $C/cal/mlruns $C/cal/runs
tar czf $OUT/c4.tgz -C /tmp c4; cat $C/times.txt; tail -5 $C/cal.log; sed -n '/reserved beyond/,$p' $C/cal/traces/*.memory.txt | head -40
