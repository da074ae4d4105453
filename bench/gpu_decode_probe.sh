#!/usr/bin/env bash
# H200 probe for the next session: 128-key blocks at B = 1, a fourth pipeline stage at
# B x Hkv >= 64, against the shipped default (bench/decode_variants.py). $OUT/r -> run.tar.gz.
set -u
source "$(dirname "$0")/gpu_lib.sh"
step decode_probe 200 python3 -m bench.decode_variants --variants v6_bn128w8_small,v6_bn128w16_small,v6_s4_big,v6 --batches 1,64,128 --rounds 30 --json "$R/decode_probe.json"
exit 0
