#!/usr/bin/env bash
# H200 run: decode GPU tests (PDL late trigger, deferred row sum), then decode v5 policy
# variants over the issue-3 grid (bench/decode_variants.py). $OUT/r -> $OUT/run.tar.gz.
set -u
source "$(dirname "$0")/gpu_lib.sh"
step decode_gpu_tests 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_decode.py
step decode_v5d 240 python3 -m bench.decode_variants --variants v5,v5_early_only,v5_ms65,v5_s4g8,v5_s6g16 --rounds 15 --json "$R/decode_v5d.json"
exit 0
