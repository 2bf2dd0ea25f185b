#!/bin/bash
# The QLoRA one-row step (7B nf4, one packed 4k row, checkpointing): zerolab's job against TRL, each alone on
# the host (GPU0, the other GPU idle), alternating, three runs each. The first run builds the model folder.
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c2; mkdir -p $C; nvidia-smi -L > $C/gpus.txt; git rev-parse HEAD >> $C/gpus.txt
r() { local name=$1 out=$2 t=$3
  CUDA_VISIBLE_DEVICES=0 timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1
  echo "$out rc $? $SECONDS" >> $C/times.txt; }
ZL=zerolab-qwen2.5-7b-1gpu-z2-nf4-mb1-ckpt-rep1; TRL=trl-qwen2.5-7b-1gpu-z0-nf4-mb1-ckpt-rep1
r $ZL zl1 260; r $TRL trl1 120; r $TRL trl2 100; r $ZL zl2 100; r $ZL zl3 100
[ $SECONDS -lt 470 ] && r $TRL trl3 $((560-SECONDS))
for f in /tmp/w0/results/*.json; do python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], d.get('gc'))" $f; done > $C/gc.txt 2>&1
rm -rf $C/*/mlruns; tar czf $OUT/c2.tgz -C /tmp c2; cat $C/gpus.txt $C/times.txt $C/gc.txt
for d in zl1 trl1 trl2 zl2 zl3 trl3; do echo "$d $(grep -h '^| zerolab\|^| trl' $C/$d/benchmark.md | cut -c1-150)"; done
