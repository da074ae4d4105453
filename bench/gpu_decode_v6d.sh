#!/usr/bin/env bash
# H200 run: after the Hkv >= 2 condition on the wide-block rule: decode GPU tests, and B = 1 / 2
# of the shipped default against BLOCK_N 32 forced (v6_bn32_small). $OUT/r -> $OUT/run.tar.gz.
set -u
source "$(dirname "$0")/gpu_lib.sh"
step decode_gpu_tests 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_decode.py
step decode_v6d 150 python3 -m bench.decode_variants --variants v6,v6_bn32_small --batches 1,2 --rounds 40 --json "$R/decode_v6d.json"
exit 0
