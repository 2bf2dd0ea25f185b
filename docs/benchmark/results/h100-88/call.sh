#!/bin/bash
# One H100: the GPU tier's quantized-base cases on one GPU (nf4, int8, fp4 across ZeRO stages and adapters,
# each trained as a job and its adapter reloaded against the checkpoint's logits) and the quantized product
# checks on CUDA (the fused LoRA node and SwiGLU-down node on nf4 and int8 bases against peft's).
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c3; mkdir -p $C; nvidia-smi -L > $C/gpus.txt
timeout 540 python -m pytest -m gpu -n 4 -q -rA -p no:cacheprovider tests/test_quantization.py tests/test_gpu_quantized.py \
  -k "cuda or (test_quantized_base_on_gpus and 1gpu)" --junitxml=$C/gpu.xml > $C/pytest.log 2>&1
echo "pytest rc $? $SECONDS" >> $C/times.txt
tar czf $OUT/c3.tgz -C /tmp c3; cat $C/gpus.txt $C/times.txt; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $C/pytest.log | tail -20
