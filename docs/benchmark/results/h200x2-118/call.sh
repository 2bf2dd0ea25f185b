#!/bin/bash
# Two GPUs: the ZeRO-3 cases of the tier that had not run under the live-parameter cap.
nvidia-smi -L > $OUT/gpus.txt
timeout -s INT 205 python -m pytest -m gpu -n 4 -q -p no:cacheprovider -rfE --junitxml=$OUT/gpu2.xml tests/test_gpu_tier.py tests/test_gpu_quantized.py -k "2gpu-dora-zero3 or 2gpu-full-zero3 or 2gpu-rslora-zero3 or 2gpu-nf4-rslora-zero3-offload" > $OUT/pytest2.log 2>&1
echo "pytest rc $? $SECONDS"; grep -v Loading $OUT/pytest2.log | grep -v Benchmark | tail -12
