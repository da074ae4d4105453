#!/usr/bin/env bash
# H200 run (fourth session): the read-bandwidth ceiling at decode sizes (bench/stream_ceiling.py),
# B = 1 split-count variants (bench/decode_variants.py), and the 8192-row prefill matrix at
# 8-warp geometries not measured since the v1.3 register fix. $OUT/r -> $OUT/run.tar.gz.
set -u
source "$(dirname "$0")/gpu_lib.sh"
step stream_ceiling 200 python3 -m bench.stream_ceiling --batches 64,128 --json "$R/stream_ceiling.json"
step decode_b1 150 python3 -m bench.decode_variants --batches 1,4 --variants v4,v4_ms65_small,v4_ms65_small_tma,v4_tma --rounds 25 --json "$R/decode_b1.json"
OUT="$R" step prefill_matrix 150 python3 -m bench.prefill --matrix-only --no-dense --no-pairs --geometry 64,4,2 --geometry 64,8,2 --geometry 128,8,2 --geometry 32,8,2
exit 0
