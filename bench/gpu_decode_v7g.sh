#!/usr/bin/env bash
# H200 run (decode v7g): PDL (entry trigger) at 3..63 KV rows vs the shipped policy (PDL only at
# B x Hkv <= 2 and >= 64), B 2..32, two passes in opposite orders behind a copy of the default
# listed first (position bias, runs 36-37). $OUT/r -> run.tar.gz.
set -u
source "$(dirname "$0")/gpu_lib.sh"
step v7g_a 200 python3 -m bench.decode_variants --variants v5,v6,v7_pdl --batches 2,4,8,16,24,32 --rounds 20 --json "$R/v7g_a.json"
step v7g_b 200 python3 -m bench.decode_variants --variants v5,v7_pdl,v6 --batches 2,4,8,16,24,32 --rounds 20 --json "$R/v7g_b.json"
exit 0
