#!/usr/bin/env bash
# Build .whl-bench/: the wheels the benchmark's `trl` system (TRL's SFTTrainer, bench/trl_sft.py)
# needs on the GPU hosts beyond their image and the project's GPU kit (.whl/, built by
# ../shared/gpu/prepare_wheels.sh): TRL, datasets, and datasets' dill and multiprocess, for
# CPython 3.12, without their dependencies (every other one is on the image: checked below); and
# py-spy, the sampling profiler that shows which of a running job's threads hold the GIL
# (`py-spy record --pid PID --threads --gil`), where a host-bound step loses time outside its own
# loop. About 4.7 MB, beside the kit's ~56-60 MiB of the 64 MiB that may travel.
#
# Run it once, from the root of your checkout:   bash bench/prepare_peer_wheels.sh
# Then, on the GPU machine, after `source shared_gpu_env.sh`:   source .whl-bench/env.sh
# (carry .whl-bench with .whl and shared_gpu_env.sh; .whl-bench/ is git-ignored).
set -euo pipefail
out=.whl-bench
# The versions the `bench` extra of pyproject.toml resolves to with transformers 5.17 and peft 0.21.
TRL_VERSION=${TRL_VERSION:-1.16.0}
wheels=("trl==$TRL_VERSION" "datasets==${DATASETS_VERSION:-5.2.0}" "dill==${DILL_VERSION:-0.4.1}"
        "multiprocess==${MULTIPROCESS_VERSION:-0.70.19}" "py-spy==${PY_SPY_VERSION:-0.4.3}")
plat=(--python-version 3.12 --implementation cp --only-binary=:all:
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_5_x86_64)

rm -rf "$out"; mkdir -p "$out"
python3 -m pip download -q --no-deps "${plat[@]}" -d "$out" "${wheels[@]}"

# Every requirement of these wheels is one of them or on the GPU image (its package list: the
# device tool's KINDS.md, "Python packages already there"); a new version that needs more fails here.
python3 - "$out" <<'PY'
import re, sys, zipfile
from pathlib import Path
on_image = set("""accelerate filelock fsspec huggingface-hub jinja2 numpy packaging pandas psutil pyarrow pyyaml
tqdm transformers xxhash""".split())
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
wheels = sorted(Path(sys.argv[1]).glob("*.whl"))
carried = {norm(w.name.split("-")[0]) for w in wheels}
missing = set()
for w in wheels:
    meta = next(n for n in zipfile.ZipFile(w).namelist() if n.endswith(".dist-info/METADATA"))
    for line in zipfile.ZipFile(w).read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            name = norm(re.match(r"Requires-Dist:\s*([A-Za-z0-9_.-]+)", line).group(1))
            if name not in carried | on_image:
                missing.add(f"{name} (for {w.name})")
if missing:
    sys.exit(f"not on the GPU image and not carried: {', '.join(sorted(missing))}; add them to this script's wheels")
PY

cat > "$out/env.sh" <<'SH'
# Install the benchmark's TRL wheels on the GPU machine (after shared_gpu_env.sh) and put them on the path.
# Byte-compiled at install, as on a user's machine: TRL's start-up figures depend on it.
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site-bench .whl-bench/*.whl >/tmp/pip-bench.log 2>&1 || { tail -20 /tmp/pip-bench.log; return 1 2>/dev/null || exit 1; }
export PYTHONPATH=/tmp/site-bench${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/site-bench/bin:$PATH
SH
du -sh "$out"; ls "$out"
echo "carry: .whl, .whl-bench and shared_gpu_env.sh; begin each command with: source shared_gpu_env.sh && source .whl-bench/env.sh"
