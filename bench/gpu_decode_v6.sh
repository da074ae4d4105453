#!/usr/bin/env bash
# H200 run: decode v6 (in-launch merge of a row's partials in one round trip): decode GPU tests
# and memcheck; code A/B against the v5 module (.peer/base_decode.py = git show 8cf89b7:
# qsa_triton/decode.py) where auto merges inline; merge-policy variants over the issue-3 grid
# and again at B = 16..64 with more rounds. $OUT/r -> $OUT/run.tar.gz.
set -u
source "$(dirname "$0")/gpu_lib.sh"
decode_tests_memcheck 240
wait  # tests and memcheck first: nothing else on the GPU while the benches time
step decode_ab 200 python3 -m bench.decode_ab --variants base,head --base .peer/base_decode.py --rounds 25 --json "$R/decode_ab.json"
step decode_v6 240 python3 -m bench.decode_variants --variants v6,v6_inl16,v6_inl32,v6_inl64,v6_kernel,v6_tma_small --rounds 15 --json "$R/decode_v6.json"
step decode_v6_focus 200 python3 -m bench.decode_variants --variants v6,v6_inl16,v6_inl32,v6_inl64 --batches 1,16,32,64 --rounds 40 --json "$R/decode_v6_focus.json"
exit 0
