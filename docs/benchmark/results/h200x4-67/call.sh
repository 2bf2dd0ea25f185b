#!/bin/bash
# Diagnosis: attention kernels; the QLoRA one-row step of zerolab (ZeRO-0, profiled ZeRO-2) and TRL (profiled);
# the one-GPU ZeRO-3 16K baseline; on H100s also the longest split row at ZeRO-2 over a pair.
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c1; mkdir -p $C; nvidia-smi -L > $C/gpus.txt; free -g >> $C/gpus.txt; nproc >> $C/gpus.txt; git rev-parse HEAD >> $C/gpus.txt
B="python jobs/benchmark.py --skip-checks"
curve() { python bench/loss_curves.py --mlruns $1/mlruns --run $2 --run $2 --out $C/$3-loss.md > /dev/null 2>&1
          python bench/loss_curves.py --mlruns $1/mlruns --metric train/grad_norm --run $2 --run $2 --out $C/$3-gn.md > /dev/null 2>&1; }
z3base() { CUDA_VISIBLE_DEVICES=$1 timeout $2 $B --run zerolab-qwen2.5-7b-1gpu-z3-rows16k-ckpt --out $C/z3base --work /tmp/wz > $C/z3base.log 2>&1
           echo "z3base rc $? $SECONDS" >> $C/times.txt; curve /tmp/wz bench-zerolab-qwen2_5-7b-1gpu-z3-rows16k-ckpt z3base; }
if grep -q H100 $C/gpus.txt; then
 (CUDA_VISIBLE_DEVICES=0 timeout 120 python bench/attention_kernels.py --out $C/attention.md > $C/attention.log 2>&1; echo "attn rc $? $SECONDS" >> $C/times.txt
  CUDA_VISIBLE_DEVICES=0 timeout 200 $B --run zerolab-qwen2.5-7b-1gpu-z0-nf4-mb1-ckpt --out $C/z0 --work /tmp/w0 > $C/z0.log 2>&1; echo "z0 rc $? $SECONDS" >> $C/times.txt
  z3base 0 $((560-SECONDS))) &
 (CUDA_VISIBLE_DEVICES=1 timeout 240 $B --run zerolab-torchrun-qwen2.5-7b-1gpu-z2-nf4-mb1-ckpt --out $C/prof-z2 --work /tmp/w1 > $C/prof-z2.log 2>&1; echo "prof-z2 rc $? $SECONDS" >> $C/times.txt
  CUDA_VISIBLE_DEVICES=1 timeout $((550-SECONDS)) $B --run trl-qwen2.5-7b-1gpu-z0-nf4-mb1-ckpt-profile --out $C/prof-trl --work /tmp/w1 > $C/prof-trl.log 2>&1; echo "prof-trl rc $? $SECONDS" >> $C/times.txt) &
 (CUDA_VISIBLE_DEVICES=2,3 timeout 550 $B --run zerolab-qwen2.5-7b-2gpu-z2-sp2-rowsmax-ckpt --out $C/rowsmax-z2 --work /tmp/w2 > $C/rowsmax-z2.log 2>&1; echo "rowsmax-z2 rc $? $SECONDS" >> $C/times.txt) &
else
 (CUDA_VISIBLE_DEVICES=0 timeout 120 python bench/attention_kernels.py --out $C/attention.md > $C/attention.log 2>&1; echo "attn rc $? $SECONDS" >> $C/times.txt
  z3base 0 $((560-SECONDS))) &
 (CUDA_VISIBLE_DEVICES=1 timeout 300 $B --run zerolab-qwen2.5-7b-1gpu-z0-nf4-mb1-ckpt --out $C/z0 --work /tmp/w0 > $C/z0.log 2>&1; echo "z0 rc $? $SECONDS" >> $C/times.txt) &
 (CUDA_VISIBLE_DEVICES=2 timeout 400 $B --run zerolab-torchrun-qwen2.5-7b-1gpu-z2-nf4-mb1-ckpt --out $C/prof-z2 --work /tmp/w1 > $C/prof-z2.log 2>&1; echo "prof-z2 rc $? $SECONDS" >> $C/times.txt) &
 (CUDA_VISIBLE_DEVICES=3 timeout 400 $B --run trl-qwen2.5-7b-1gpu-z0-nf4-mb1-ckpt-profile --out $C/prof-trl --work /tmp/w3 > $C/prof-trl.log 2>&1; echo "prof-trl rc $? $SECONDS" >> $C/times.txt) &
fi
wait
rm -rf $C/*/mlruns; tar czf $OUT/c1.tgz -C /tmp c1; cat $C/times.txt; tail -n 3 $C/*.log | cut -c1-300
