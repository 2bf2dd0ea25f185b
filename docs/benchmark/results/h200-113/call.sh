#!/bin/bash
# One GPU: a frozen product's speed back to back against with memory-bound work between (power.py).
C=$OUT/pw; mkdir -p $C; nvidia-smi -L > $C/gpus.txt
timeout 100 python .calls/power.py > $C/power.txt 2>&1; echo "rc $?" >> $C/power.txt
cp /tmp/smi.csv $C/; cat $C/power.txt
cat $C/smi.csv | cut -d, -f1-4 | awk "NR%2==1"
