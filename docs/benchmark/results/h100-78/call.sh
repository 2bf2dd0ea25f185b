#!/bin/bash
# One H100: the quantized GPU tier (jobs on one GPU through the fused LoRA node on 4-bit bases) and the fused-node checks.
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c7; mkdir -p $C; nvidia-smi -L > $C/gpus.txt
timeout 540 python -m pytest -q -p no:cacheprovider -m gpu -n 4 tests/test_gpu_quantized.py tests/test_quantization.py -k "not resumes" \
  --junitxml=$C/gpu.xml > $C/gpu.log 2>&1; echo "rc $? $SECONDS" >> $C/times.txt
tar czf $OUT/c7.tgz -C /tmp c7; tail -25 $C/gpu.log; cat $C/times.txt
