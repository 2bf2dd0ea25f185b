#!/bin/bash
export T0=$(date +%s)
# Same lease if still warm: the parent of the target-rows change and TRL beside this tree.
[ -d /tmp/w0 ] || { echo COLD; bash docs/benchmark/results/h200-114/ab.sh l2 590 new:w:260; }
bash docs/benchmark/results/h200-114/ab.sh l2 590 par:par1:80 new:new4:80 trl:trl1:80 par:par2:80 new:new5:80 trl:trl2:80 par:par3:80 new:new6:80 trl:trl3:80
