#!/bin/bash
# The one-GPU tier (quantized cases with bitsandbytes among them) on this tree, five cases at a time.
nvidia-smi -L > $OUT/gpus.txt
python -c "import bitsandbytes, sys; print('bitsandbytes', bitsandbytes.__version__)" 2>&1 | tail -1
timeout -s INT 545 python -m pytest -m gpu -n 5 -q -p no:cacheprovider -rfE --junitxml=$OUT/gpu.xml > $OUT/pytest.log 2>&1
echo "pytest rc $? $SECONDS"; grep -v Loading $OUT/pytest.log | tail -25
