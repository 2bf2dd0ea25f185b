#!/bin/bash
# One H100: zerolab's own int8 products (no LLM.int8() input or outlier-column copies held). The GPU
# tier's quantized cases and product checks first, then the int8 rows of h100-77 and held-out set M,
# each predicted before it runs by the code that runs it.
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c1; mkdir -p $C; nvidia-smi -L > $C/gpus.txt
timeout 170 python -m pytest -m gpu -n 4 -q -p no:cacheprovider tests/test_quantization.py tests/test_gpu_quantized.py \
  -k "cuda or (test_quantized_base_on_gpus and 1gpu)" --junitxml=$C/gpu.xml > $C/pytest.log 2>&1
echo "pytest rc $? $SECONDS" >> $C/times.txt
timeout $((420-SECONDS)) python jobs/benchmark.py --skip-checks --suite int8-heldout --out $C/int8 --work /tmp/w0 > $C/int8.log 2>&1
echo "int8 rc $? $SECONDS" >> $C/times.txt
t=$((585-SECONDS))
[ $t -gt 90 ] && { timeout $t python bench/calibrate_memory.py --held-out --cases held-out-m-int8 --models /tmp/w0/models --out $C/set-m > $C/set-m.log 2>&1; echo "set-m rc $? $SECONDS" >> $C/times.txt; }
rm -rf $C/*/mlruns $C/*/runs $C/*/models; tar czf $OUT/c1.tgz -C /tmp c1; cat $C/gpus.txt $C/times.txt
tail -5 $C/pytest.log; grep -h '^| zerolab' $C/int8/benchmark.md | cut -c1-200; cut -d, -f1,5-13 $C/int8/bench_calibration.csv
grep -h "^| qwen" $C/set-m/memory_heldout.md | cut -c1-220
