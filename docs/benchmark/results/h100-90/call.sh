#!/bin/bash
# One H100: where a first launch's seconds go. zerolab's first run (the machine's first: the model is
# built, nothing cached), then zerolab and TRL each as a first launch (fresh data cache, fresh Triton
# cache) under py-spy, TRL once more unobserved with a fresh Triton cache; then 7B at one 4k row,
# ZeRO-2 against ZeRO-3 (leaf layers, the default).
source .whl-bench/env.sh
mkdir -p /tmp/spy; python3 -c "import lzma; open(\"/tmp/spy/py-spy\",\"wb\").write(lzma.open(\".calls/py-spy.xz\").read())"; chmod +x /tmp/spy/py-spy; export PATH=/tmp/spy:$PATH
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/pa; mkdir -p $C; nvidia-smi -L > $C/gpus.txt
r() { local name=$1 out=$2 t=$3
  timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns; tar czf $OUT/pa.tgz -C /tmp pa
  echo "$out $(grep -h '^| zerolab\|^| trl' $C/$out/benchmark.md | cut -c1-170)"; }
ZL=zerolab-qwen2.5-7b-1gpu-z2-rep1; TRL=trl-qwen2.5-7b-1gpu-z0-rep1
r $ZL zl1 260
CMD=$(grep -h '^\$ python bench/zerolab_run.py' $C/zl1/runs.log | head -1 | sed 's/^\$ //; s#\$WORK#/tmp/w0#g; s#run.name=bench-#run.name=spy-#; s#--out [^ ]*#--out /tmp/w0/results/spy.json#')
echo "$CMD" > $C/spy-zl.cmd
spy() { local out=$1; shift; local t0=$(date +%s.%N)
  timeout 150 py-spy record -r 100 --idle --format raw -o $C/$out.txt -- "$@" > $C/$out.log 2>&1
  echo "$out rc $? launch $t0 $SECONDS" >> $C/times.txt; tar czf $OUT/pa.tgz -C /tmp pa; }
ZEROLAB_CACHE=/tmp/zc-spy TRITON_CACHE_DIR=/tmp/tc-spy1 spy spy-zl $CMD
python -c "import json;m=json.load(open('/tmp/w0/results/spy.json'))['metrics'];print('spy-zl first_step_unix',m.get('perf/first_step_unix'),m.get('perf/startup_s'))" >> $C/times.txt
CUDA_VISIBLE_DEVICES=0 TRITON_CACHE_DIR=/tmp/tc-spy2 spy spy-trl python bench/trl_sft.py --model /tmp/w0/models/random-qwen2.5-7b \
  --data /tmp/w0/data/sft-mix-seed0-max4096.jsonl --out /tmp/w0/results/trl-spy --steps 12 --window 6 --micro-batch 2 \
  --max-seq-length 4096 --attn auto --kernels auto --quantization none --profile-steps 0
cat /tmp/w0/results/trl-spy*.json 2>/dev/null | head -c 600 >> $C/times.txt; echo >> $C/times.txt
TRITON_CACHE_DIR=/tmp/tc-trl1 r $TRL trl1 150
r zerolab-qwen2.5-7b-1gpu-z2 z2mb1 120
r zerolab-qwen2.5-7b-1gpu-z3-leaf z3mb1 150
cat $C/times.txt
