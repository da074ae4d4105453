#!/usr/bin/env bash
# H200 run: decode v6c, B = 1 only: BLOCK_N 64 (one 64-row block per split, 33 splits) against
# the shipped BLOCK_N 32 (65 splits), 60 rounds. $OUT/r -> $OUT/run.tar.gz.
set -u
source "$(dirname "$0")/gpu_lib.sh"
step decode_v6c 200 python3 -m bench.decode_variants --variants v6,v6_bn64_small,v6_bn64s2_small,v6_bn64w8_small --batches 1 --rounds 60 --json "$R/decode_v6c.json"
step decode_v6c_again 200 python3 -m bench.decode_variants --variants v6,v6_bn64_small,v6_bn64s2_small --batches 1,4 --rounds 60 --json "$R/decode_v6c_again.json"
exit 0
