#!/bin/bash
# One H100: first launches (empty data and Triton caches of their own), alternating: the tree before
# kernels_ahead (base, c7c8428), this tree (new), this tree with the compiling process at nice 19 (nice);
# then TRL twice more. Each zerolab run's Triton cache listed with times.
source .whl-bench/env.sh
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/ka2; mkdir -p $C /tmp/base /tmp/nice; nvidia-smi -L > $C/gpus.txt; nproc >> $C/gpus.txt; uname -r >> $C/gpus.txt
rm -rf /tmp/base/* /tmp/nice/*; tar xzf .calls/base.tgz -C /tmp/base
cp -r platform bench jobs ds_configs /tmp/nice/
sed -i 's/^    channel = os.fdopen(os.dup(1), "w")$/    os.nice(19)\n    channel = os.fdopen(os.dup(1), "w")/' /tmp/nice/platform/zerolab/kernels_ahead.py
grep -c "os.nice(19)" /tmp/nice/platform/zerolab/kernels_ahead.py >> $C/gpus.txt
NEWPP=$PYTHONPATH; BASEPP=$(echo $PYTHONPATH | sed "s#$(pwd)/platform#/tmp/base/platform#; s#:$(pwd):#:/tmp/base:#")
NICEPP=$(echo $PYTHONPATH | sed "s#$(pwd)/platform#/tmp/nice/platform#; s#:$(pwd):#:/tmp/nice:#")
r() { local tree=$1 name=$2 out=$3 t=$4 pp=$NEWPP dir=$(pwd)
  [ $tree = base ] && { pp=$BASEPP; dir=/tmp/base; }
  [ $tree = nice ] && { pp=$NICEPP; dir=/tmp/nice; }
  (cd $dir && PYTHONPATH=$pp timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work /tmp/w0 > $C/$out.log 2>&1)
  echo "$out rc $? $SECONDS" >> $C/times.txt; rm -rf $C/$out/mlruns
  find /tmp/w0/first-launch/$name/triton -name '*.json' ! -name '__grp__*' -printf '%TT %f\n' 2>/dev/null | sort > $C/$out/triton-cache.txt
  tar czf $OUT/ka2.tgz -C /tmp ka2
  echo "$out $(grep -h '^| zerolab\|^| trl' $C/$out/benchmark.md | cut -c1-170)"; }
ZL=zerolab-qwen2.5-7b-1gpu-z2-rep1; TRL=trl-qwen2.5-7b-1gpu-z0-rep1
[ -d /tmp/w0/models/random-qwen2.5-7b ] || T0=200
r base $ZL base3 $((110+T0)); r new $ZL new3 110; r nice $ZL nice1 110; r new $TRL trl2 110
r base $ZL base4 110; r new $ZL new4 110; r nice $ZL nice2 110; r new $TRL trl3 110
cat $C/times.txt
for d in base3 new3 nice1 base4 new4 nice2; do echo "== $d"; grep -h "start-up:\|kernels_ahead\|worker ready\|Liger kernels" $C/$d/runs.log | cut -c1-330; done
for d in new3 nice1; do echo "== $d"; cat $C/$d/triton-cache.txt; done
