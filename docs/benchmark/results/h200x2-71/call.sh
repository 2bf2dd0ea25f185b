#!/bin/bash
# GPU0: 7B two-row 4k step, this tree against 4670d4f, alternating (medians of three).
# GPU1: the QLoRA one-row step: zerolab's job and the torchrun loop (py-spy on their steady steps), the job again unobserved; GC counts.
mkdir -p /tmp/spy; python3 -c "import lzma,sys; open(\"/tmp/spy/py-spy\",\"wb\").write(lzma.open(\".lease/s49/py-spy.xz\").read())"; chmod +x /tmp/spy/py-spy; export PATH=/tmp/spy:$PATH
export MLFLOW_ALLOW_FILE_STORE=true
C=/tmp/c1; mkdir -p $C /tmp/base; nvidia-smi -L > $C/gpus.txt; git rev-parse HEAD >> $C/gpus.txt
cat /proc/sys/kernel/yama/ptrace_scope >> $C/gpus.txt 2>&1; id -u >> $C/gpus.txt; grep CapEff /proc/self/status >> $C/gpus.txt
tar xzf .lease/s49/base-4670d4f.tgz -C /tmp/base
NEWPP=$PYTHONPATH; BASEPP=$(echo $PYTHONPATH | sed "s#$(pwd)/platform#/tmp/base/platform#; s#:$(pwd):#:/tmp/base:#")
echo "new $NEWPP / base $BASEPP" >> $C/gpus.txt
r() { local gpu=$1 tree=$2 name=$3 out=$4 work=$5 t=$6 pp=$NEWPP dir=$(pwd)
  [ $tree = base ] && { pp=$BASEPP; dir=/tmp/base; }
  (cd $dir && CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=$pp timeout $t python jobs/benchmark.py --skip-checks --run $name --out $C/$out --work $work > $C/$out.log 2>&1)
  echo "$out rc $? $SECONDS" >> $C/times.txt; }
spy() { local pat=$1 out=$2 pid=""
  for i in $(seq 600); do pid=$(pgrep -n -f "$pat"); [ -n "$pid" ] && py-spy dump --pid $pid 2>>$C/$out.err | grep -q "optimizer_step\|training_step" && break; sleep 0.5; done
  sleep 3; py-spy record --pid $pid --threads --gil --nonblocking -r 250 -d 4 --format raw -o $C/$out.txt >> $C/$out.err 2>&1
  py-spy record --pid $pid --threads --nonblocking -r 250 -d 3 --format raw -o $C/$out-all.txt >> $C/$out.err 2>&1; }
(r 0 new zerolab-qwen2.5-7b-1gpu-z2-mb2 4k-new1 /tmp/w0 300
 r 0 base zerolab-qwen2.5-7b-1gpu-z2-mb2 4k-base1 /tmp/w0 150
 r 0 base zerolab-qwen2.5-7b-1gpu-z2-mb2 4k-base2 /tmp/w0 150
 r 0 new zerolab-qwen2.5-7b-1gpu-z2-mb2 4k-new2 /tmp/w0 150
 r 0 new zerolab-qwen2.5-7b-1gpu-z2-mb2 4k-new3 /tmp/w0 150
 [ $SECONDS -lt 480 ] && r 0 base zerolab-qwen2.5-7b-1gpu-z2-mb2 4k-base3 /tmp/w0 $((560-SECONDS))) &
(spy bench/zerolab_run.py pyspy-zl & SP=$!; r 1 new zerolab-qwen2.5-7b-1gpu-z2-nf4-mb1-ckpt-rep1 qlora-zl /tmp/w1 300; kill $SP 2>/dev/null; wait
 spy bench/torchrun_loop.py pyspy-tr & SP=$!; r 1 new zerolab-torchrun-qwen2.5-7b-1gpu-z2-nf4-mb1-ckpt qlora-tr /tmp/w1 200; kill $SP 2>/dev/null; wait
 [ $SECONDS -lt 470 ] && r 1 new zerolab-qwen2.5-7b-1gpu-z2-nf4-mb1-ckpt-rep2 qlora-zl2 /tmp/w1 $((560-SECONDS))) &
wait
for f in /tmp/w0/results/*.json /tmp/w1/results/*.json; do python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], d.get('gc'))" $f; done > $C/gc.txt 2>&1
cp -r /tmp/w0/results $C/results-w0; cp -r /tmp/w1/results $C/results-w1
rm -rf $C/*/mlruns; tar czf $OUT/c1.tgz -C /tmp c1; cat $C/gpus.txt $C/times.txt $C/gc.txt; grep -h "^| zerolab\|^| trl" $C/*/benchmark.md | cut -c1-200; head -c 600 $C/pyspy-zl.err
