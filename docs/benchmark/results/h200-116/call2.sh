#!/bin/bash
export T0=$(date +%s)
# Same lease if still warm: TRL beside this tree.
[ -d /tmp/w0 ] || { echo COLD; bash docs/benchmark/results/h200-114/ab.sh l5 590 new:w:260; }
bash docs/benchmark/results/h200-114/ab.sh l5 590 trl:trl1:80 new:new4:80 trl:trl2:80 new:new5:80 trl:trl3:80 new:new6:80
