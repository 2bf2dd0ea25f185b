#!/bin/bash
# Attention kernels: the kernels alone, then zerolab runs with FlashAttention-2 against cuDNN (model.varlen_kernel);
# 256K with the default (cuDNN where it passes); the QLoRA one-row pair against TRL.
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c2; mkdir -p $C; nvidia-smi -L > $C/gpus.txt; git rev-parse HEAD >> $C/gpus.txt
B="python jobs/benchmark.py --skip-checks"
r() { local gpu=$1 name=$2 out=$3 work=$4 t=$5; CUDA_VISIBLE_DEVICES=$gpu timeout $t $B --run $name --out $C/$out --work $work > $C/$out.log 2>&1; echo "$out rc $? $SECONDS" >> $C/times.txt; }
(CUDA_VISIBLE_DEVICES=0 timeout 150 python bench/attention_kernels.py --out $C/attention.md > $C/attention.log 2>&1; echo "attn rc $? $SECONDS" >> $C/times.txt
 r 0 zerolab-qwen2.5-7b-1gpu-z2-mb2-flash mb2-flash /tmp/w0 150
 r 0 zerolab-qwen2.5-7b-1gpu-z2-mb2-cudnn mb2-cudnn /tmp/w0 130
 r 0 zerolab-qwen2.5-0.5b-1gpu-z2-rows64k-flash 64k-flash /tmp/w0 90
 r 0 zerolab-qwen2.5-0.5b-1gpu-z2-rows64k-cudnn 64k-cudnn /tmp/w0 $((570-SECONDS))) &
(r 1 zerolab-qwen2.5-7b-1gpu-z2-rows32k-tiled-flash 32k-flash /tmp/w1 170
 r 1 zerolab-qwen2.5-7b-1gpu-z2-rows32k-tiled-cudnn 32k-cudnn /tmp/w1 150
 r 1 zerolab-qwen2.5-7b-1gpu-z2-rows128k-ckpt-cudnn 128k-cudnn /tmp/w1 $((570-SECONDS))) &
(r 2 zerolab-qwen2.5-7b-1gpu-z2-rows128k-ckpt-flash 128k-flash /tmp/w2 260
 r 2 zerolab-qwen2.5-7b-1gpu-z2-nf4-mb1-ckpt-rep1 qlora-zl /tmp/w2 140
 r 2 trl-qwen2.5-7b-1gpu-z0-nf4-mb1-ckpt-rep1 qlora-trl /tmp/w2 $((570-SECONDS))) &
(r 3 zerolab-qwen2.5-7b-1gpu-z2-rows256k-ckpt-offload-tiled 256k /tmp/w3 570) &
wait
rm -rf $C/*/mlruns; tar czf $OUT/c2.tgz -C /tmp c2; cat $C/times.txt; grep -h "^| zerolab\|^| trl" $C/*/benchmark.md | cut -c1-200; tail -n 25 $C/attention.md
