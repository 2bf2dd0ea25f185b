#!/bin/bash
# Rows of one sample on cuDNN's attention (SDPA) against FlashAttention-2; 256K with the default; the kernels'
# GPU tests; the QLoRA one-row pair against TRL.
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c3; mkdir -p $C; nvidia-smi -L > $C/gpus.txt; git rev-parse HEAD >> $C/gpus.txt
B="python jobs/benchmark.py --skip-checks"
r() { local gpu=$1 name=$2 out=$3 work=$4 t=$5; CUDA_VISIBLE_DEVICES=$gpu timeout $t $B --run $name --out $C/$out --work $work > $C/$out.log 2>&1; echo "$out rc $? $SECONDS" >> $C/times.txt; }
(r 0 zerolab-qwen2.5-7b-1gpu-z2-rows32k-tiled-flash 32k-flash /tmp/w0 240
 r 0 zerolab-qwen2.5-7b-1gpu-z2-rows32k-tiled-cudnn 32k-cudnn /tmp/w0 170
 CUDA_VISIBLE_DEVICES=0 timeout $((555-SECONDS)) python -m pytest -q -m gpu tests/test_kernels.py -p no:cacheprovider > $C/gpu-kernels.log 2>&1; echo "gpu-kernels rc $? $SECONDS" >> $C/times.txt) &
(r 1 zerolab-qwen2.5-7b-1gpu-z2-rows128k-ckpt-cudnn 128k-cudnn /tmp/w1 300
 r 1 zerolab-qwen2.5-0.5b-1gpu-z2-rows64k-flash 64k-flash /tmp/w1 130
 r 1 zerolab-qwen2.5-0.5b-1gpu-z2-rows64k-cudnn 64k-cudnn /tmp/w1 $((555-SECONDS))) &
(r 2 zerolab-qwen2.5-7b-1gpu-z2-nf4-mb1-ckpt-rep1 qlora-zl /tmp/w2 200
 r 2 trl-qwen2.5-7b-1gpu-z0-nf4-mb1-ckpt-rep1 qlora-trl /tmp/w2 $((555-SECONDS))) &
(r 3 zerolab-qwen2.5-7b-1gpu-z2-rows256k-ckpt-offload-tiled 256k /tmp/w3 555) &
wait
rm -rf $C/*/mlruns; tar czf $OUT/c3.tgz -C /tmp c3; cat $C/times.txt; grep -h "^| zerolab\|^| trl" $C/*/benchmark.md | cut -c1-220; tail -n 4 $C/gpu-kernels.log
