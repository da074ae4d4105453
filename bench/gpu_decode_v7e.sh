#!/usr/bin/env bash
# H200 run (decode v7e): B = 1 fixed cost against the split kernel's shared memory (stages,
# BLOCK_N, warps), 1-key and saturated rows. $OUT/r -> run.tar.gz.
set -u
source "$(dirname "$0")/gpu_lib.sh"
step v7e 200 python3 -m bench.decode_variants --variants v6,v7_bn64w8s2_small,v7_bn64w8s1_small,v7_bn64w4s2_small,v6_bn32_small,v7_s2_small,v7_s5_small --tp TP1,TP2 --batches 1 --rows k1,saturated --rounds 30 --json "$R/v7e.json"
exit 0
