#!/bin/bash
# the jagged dK/dV cases that faulted in session 9 (lse boxes from packed row starts not 16-byte aligned);
# usage: PYTHONPATH=. bash scripts/diag_varlen_bwd_bisect.sh
d() { echo "### lq=$1 lk=$2 H=$3 D=$4 causal=$5 variant=$6"; DIAG_LQ=$1 DIAG_LK=$2 DIAG_H=$3 DIAG_D=$4 DIAG_CAUSAL=$5 timeout 60 python scripts/diag_varlen_bwd_gluon.py "$6" 2>&1 | grep -E "^(OK|FAIL)"; }
d 2,3 2,3 2,1 128 0 dkdv:split:key
d 129,1000 129,1000 2,1 128 0 dkdv:whole:tile
d 4095,1,129,1000,33,0 4095,7,129,1500,1,3 8,2 128 0 public
d 5,0,33,70,1,2,700,1500 9,4,0,40,129,1,300,1800 8,1 64 1 public
