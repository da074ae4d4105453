#!/usr/bin/env bash
# H200 run (decode v7h, experiments from a review): K/V loads evict-first in L2 (cu_seqlens, q
# and the partials stay resident across calls at large B) and the merge kernel given the split
# kernel's shared-memory carveout preference (no carveout change between the two grids), at
# B = 1 and 64 (+ 1-key rows: the fixed cost) and B = 128. $OUT/r -> run.tar.gz.
set -u
source "$(dirname "$0")/gpu_lib.sh"
step v7h_a 200 python3 -m bench.decode_variants --variants v5,v6,v7_evict,v7_carve,v7_evict_carve --batches 1,64,128 --rows saturated,mixed,k1 --rounds 20 --json "$R/v7h_a.json"
step v7h_b 200 python3 -m bench.decode_variants --variants v5,v7_evict_carve,v7_carve,v7_evict,v6 --batches 1,64,128 --rows saturated,mixed,k1 --rounds 20 --json "$R/v7h_b.json"
exit 0
