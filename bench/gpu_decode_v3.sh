#!/usr/bin/env bash
# H200 run (decode v3 + prefill v1.3): prefill `qsa check --full --peer sglang` shards and the
# Triton decode GPU tests in parallel (no timing there), then, alone on the GPU, the decode policy
# sweep (bench/decode_variants.py) and the 8192-row prefill matrix at a few geometries.
# Budget < 9 minutes; everything under $OUT/r, tarred to $OUT/run.tar.gz.
set -u
source "$(dirname "$0")/gpu_lib.sh"
check_shards 200 prefill/ordinary prefill/chunk prefill/paged
step decode_gpu_tests 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_decode.py &
wait
step decode_variants 230 python3 -m bench.decode_variants --json "$R/decode_variants.json" --rounds 7
OUT="$R" step prefill_matrix 110 python3 -m bench.prefill --matrix-only --no-dense --no-pairs --geometry 64,4,2 --geometry 64,4,3 --geometry 32,4,3
exit 0
