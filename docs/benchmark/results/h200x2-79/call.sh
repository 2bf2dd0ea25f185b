#!/bin/bash
# Two GPUs: the quantized tier's two-GPU nf4 LoRA cases (ZeRO-3 with leaf layers and ZeRO-2 packed) through the fused node.
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c8; mkdir -p $C; nvidia-smi -L > $C/gpus.txt
timeout 220 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_quantized.py -k "2gpu-nf4-lora-zero3 or 2gpu-nf4-lora-zero2-packed" \
  --junitxml=$C/gpu.xml > $C/gpu.log 2>&1; echo "rc $? $SECONDS" >> $C/times.txt
tar czf $OUT/c8.tgz -C /tmp c8; tail -5 $C/gpu.log; cat $C/times.txt
