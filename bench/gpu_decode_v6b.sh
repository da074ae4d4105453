#!/usr/bin/env bash
# H200 run: decode v6b (the in-launch merge as elementwise [HT] / [HT, D] loads, unrolled per
# chunk, no barrier between them; v6a's [tile, HT, D] reduction measured ~6 us slower than the
# merge kernel): code A/B against the v5 module and merge-policy variants at B = 1..128.
set -u
source "$(dirname "$0")/gpu_lib.sh"
step decode_ab 150 python3 -m bench.decode_ab --variants base,head --base .peer/base_decode.py --rounds 25 --json "$R/decode_ab.json"
step decode_v6b 200 python3 -m bench.decode_variants --variants v6,v6_inl16,v6_inl32,v6_inl64,v6_kernel --batches 1,16,32,64,128 --rounds 25 --json "$R/decode_v6b.json"
step decode_gpu_tests 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_decode.py -k "inline or merge or graph or counters"
exit 0
