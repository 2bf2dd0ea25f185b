#!/bin/bash
# The QLoRA one-row pair alone on the host (zerolab's job and TRL, one GPU each, side by side); the kernels' GPU tests.
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c4; mkdir -p $C; nvidia-smi -L > $C/gpus.txt; git rev-parse HEAD >> $C/gpus.txt
B="python jobs/benchmark.py --skip-checks"
(CUDA_VISIBLE_DEVICES=0 timeout 190 $B --run zerolab-qwen2.5-7b-1gpu-z2-nf4-mb1-ckpt-rep1 --out $C/qlora-zl --work /tmp/w0 > $C/qlora-zl.log 2>&1; echo "qlora-zl rc $? $SECONDS" >> $C/times.txt
 CUDA_VISIBLE_DEVICES=0 timeout $((245-SECONDS)) python -m pytest -q -m gpu tests/test_kernels.py -k "one_sample or padded_loss or padding_free" -p no:cacheprovider > $C/gpu-kernels.log 2>&1; echo "gpu-kernels rc $? $SECONDS" >> $C/times.txt) &
(CUDA_VISIBLE_DEVICES=1 timeout 200 $B --run trl-qwen2.5-7b-1gpu-z0-nf4-mb1-ckpt-rep1 --out $C/qlora-trl --work /tmp/w1 > $C/qlora-trl.log 2>&1; echo "qlora-trl rc $? $SECONDS" >> $C/times.txt) &
wait
rm -rf $C/*/mlruns; tar czf $OUT/c4.tgz -C /tmp c4; cat $C/times.txt; grep -h "^| zerolab\|^| trl" $C/*/benchmark.md | cut -c1-220; grep -h "step 1[0-9]/\|first optimizer" $C/*/runs.log | cut -c1-200; tail -n 3 $C/gpu-kernels.log
