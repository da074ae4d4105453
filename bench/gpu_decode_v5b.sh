#!/usr/bin/env bash
# H200 run: per-program timeline of the split kernel (bench/decode_timeline.py: HBM vs
# L2-resident K/V), then decode v5 variants (deferred row sum, 65 splits at B = 1, BLOCK_N 64 at
# B x Hkv >= 32) over the issue-3 grid. $OUT/r -> $OUT/run.tar.gz.
set -u
source "$(dirname "$0")/gpu_lib.sh"
step decode_timeline 150 python3 -m bench.decode_timeline --json "$R/decode_timeline.json"
step decode_v5b 240 python3 -m bench.decode_variants --variants v4,v5_defer,v5_defer_ms65,v5_defer_bn64s2,v5_defer_bn64s3 --rounds 15 --json "$R/decode_v5b.json"
exit 0
