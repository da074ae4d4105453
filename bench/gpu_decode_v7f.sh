#!/usr/bin/env bash
# H200 run (decode v7f): TP1 B = 1 fixed cost and time by split-kernel geometry, with a copy of
# the default listed first to absorb the first-listed bias (runs 36-37), in two orders.
set -u
source "$(dirname "$0")/gpu_lib.sh"
step v7f_a 150 python3 -m bench.decode_variants --variants v5,v6,v6_bn32_small,v7_bn64w8s1_small,v7_bn64w8s2_small --tp TP1 --batches 1 --rows k1,k64,saturated,mixed --rounds 40 --json "$R/v7f_a.json"
step v7f_b 150 python3 -m bench.decode_variants --variants v5,v7_bn64w8s2_small,v7_bn64w8s1_small,v6_bn32_small,v6 --tp TP1 --batches 1 --rows k1,k64,saturated,mixed --rounds 40 --json "$R/v7f_b.json"
exit 0
