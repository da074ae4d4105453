#!/usr/bin/env bash
# H200 run (decode v7d): the fixed cost of a call. B = 1 and B = 64 with 1-, 64- and 128-key
# rows (plan sized for 2051: same grids and launches as saturated, one block of work per row)
# against saturated rows; one launch (max_splits 1) vs split + merge. $OUT/r -> run.tar.gz.
set -u
source "$(dirname "$0")/gpu_lib.sh"
step v7d_b1 200 python3 -m bench.decode_variants --variants v6,v7_ms1_small --tp TP1,TP2,TP4 --batches 1 --rows k1,k64,k128,saturated --rounds 30 --json "$R/v7d_b1.json"
step v7d_b64 200 python3 -m bench.decode_variants --variants v6,v7_s1_st6 --tp TP1,TP2,TP4 --batches 64 --rows k1,k64,saturated --rounds 20 --json "$R/v7d_b64.json"
exit 0
