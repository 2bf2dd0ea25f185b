#!/bin/bash
export T0=$(date +%s)
# GPU kernels tests (real Liger: the fused loss with the chunk constant) beside the warm-up run.
mkdir -p /tmp/k; (timeout 200 python -m pytest -q -n 0 -p no:cacheprovider -m gpu tests/test_kernels.py > /tmp/k/pytest_kernels.log 2>&1; echo "pytest rc $? $SECONDS" >> /tmp/k/times.txt) &
bash docs/benchmark/results/h200-114/ab.sh l4 590 new:w:260
wait; cat /tmp/k/times.txt; tail -4 /tmp/k/pytest_kernels.log; cp /tmp/k/pytest_kernels.log $OUT/
bash docs/benchmark/results/h200-114/ab.sh l4 590 hb:hb1:60 new:new1:60 mof:mof1:70 hb:hb2:60 new:new2:60 mof:mof2:70 hb:hb3:60 new:new3:60 mof:mof3:70
