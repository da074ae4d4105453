#!/usr/bin/env bash
# H200 run: decode v5 loop variants (split Q·Kᵀ, deferred row sum, 65 splits at B = 1) against the
# shipped v4 and upstream over the whole issue-3 grid (bench/decode_variants.py), then B = 1 and
# B = 64 again with more rounds. $OUT/r -> $OUT/run.tar.gz.
set -u
source "$(dirname "$0")/gpu_lib.sh"
V=v4,v5_qk2,v5_defer,v5_qk2_defer,v5_qk4_defer,v5_qk2_defer_ms65
step decode_v5 300 python3 -m bench.decode_variants --variants $V --rounds 15 --json "$R/decode_v5.json"
step decode_v5_b1_b64 150 python3 -m bench.decode_variants --variants $V --batches 1,64 --rounds 40 --json "$R/decode_v5_b1_b64.json"
exit 0
