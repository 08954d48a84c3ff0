#!/bin/bash
# bisect the Gluon jagged dK/dV fault over shapes and configs (session 9); usage: bash scripts/diag_varlen_bwd_bisect.sh
d() { echo "### lq=$1 lk=$2 H=$3 D=$4 causal=$5 variant=$6"; DIAG_LQ=$1 DIAG_LK=$2 DIAG_H=$3 DIAG_D=$4 DIAG_CAUSAL=$5 timeout 60 python scripts/diag_varlen_bwd_gluon.py "$6" 2>&1 | grep -E "^(OK|FAIL)"; }
d 2,3 2,3 2,1 128 0 dkdv:split:key
d 3 3 2,1 128 0 dkdv:split:key
d 64,64 64,64 2,1 128 0 dkdv:split:key
d 1000,129 1000,129 2,1 128 0 dkdv:split:key
d 2,3 2,3 2,2 128 0 dkdv:split:key
d 2,3 2,3 2,1 128 0 dkdv:split:key:defer_dk=0
d 129,1000 129,1000 2,1 128 0 dkdv:split:key
d 2,3 2,3 2,1 64 0 dkdv:split:key
