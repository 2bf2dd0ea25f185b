#!/bin/bash
# The restore-order test on the tree before its fix (base: b403e05's platform, the same long_rows.py as the fix's parent, this test) and with it (new), then
# the GPU tier on this tree (cbbafc4) under -n 4. One H200, a fresh machine.
mkdir -p /tmp/b2 && tar xzf .calls/base2.tgz -C /tmp/b2
BASEPP=$(echo $PYTHONPATH | sed "s#$(pwd)/platform#/tmp/b2/platform#")
T="tests/test_long_rows.py -m gpu -q -p no:cacheprovider -n 0"
PYTHONPATH=$BASEPP timeout 90 python -m pytest $T -k "restore_waits" 2>&1 | grep -v Loading | tail -4
timeout 120 python -m pytest $T 2>&1 | grep -v Loading | tail -4
timeout 480 python -m pytest -m gpu -n 4 -q -p no:cacheprovider --junitxml=$OUT/gpu-tier.xml 2>&1 | grep -v Loading | tail -15
