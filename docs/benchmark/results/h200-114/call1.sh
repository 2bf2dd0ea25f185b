#!/bin/bash
export T0=$(date +%s)
# GPU kernels tests (real Liger: the fused loss over target rows, training and eval) beside the warm-up run.
mkdir -p /tmp/k; (timeout 200 python -m pytest -q -n 0 -p no:cacheprovider -m gpu tests/test_kernels.py > /tmp/k/pytest_kernels.log 2>&1; echo "pytest rc $? $SECONDS" >> /tmp/k/times.txt) &
bash docs/benchmark/results/h200-114/ab.sh l1 590 new:w:260
wait; cat /tmp/k/times.txt; tail -4 /tmp/k/pytest_kernels.log; cp /tmp/k/pytest_kernels.log $OUT/
bash docs/benchmark/results/h200-114/ab.sh l1 590 mof:mof1:80 new:new1:80 mof:mof2:80 new:new2:80 mof:mof3:80 new:new3:80
