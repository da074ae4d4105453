#!/usr/bin/env bash
# H200 run (decode v7a): L2 prefetch of each split's first K/V blocks before gdc_wait, against
# the shipped default; the split-balance diagnostic (2048-key rows: 4 equal splits; B = 66:
# 264 programs, two per SM); TMA at the 64-key TP1 B = 1 geometry. $OUT/r -> run.tar.gz.
# Ran (run 39) on the kernel of commit 3c4ce5e with decode_variants' v7_pf1 / v7_pf2 /
# v7_pf2_pdl variants; the prefetch and those variants were removed after it (1f3843c).
set -u
source "$(dirname "$0")/gpu_lib.sh"
step v7a_pf 240 python3 -m bench.decode_variants --variants v6,v7_pf1,v7_pf2 --batches 1,64,128 --rounds 20 --json "$R/v7a_pf.json"
step v7a_even 120 python3 -m bench.decode_variants --variants v6,v7_pf2 --tp TP2,TP4 --batches 64,66 --rows saturated,even --rounds 20 --json "$R/v7a_even.json"
step v7a_tma 60 python3 -m bench.decode_variants --variants v6,v6_tma_small --tp TP1 --batches 1 --rounds 40 --json "$R/v7a_tma.json"
step v7a_mid 120 python3 -m bench.decode_variants --variants v6,v7_pdl,v7_pf2_pdl --batches 4,16,32 --rows saturated --rounds 15 --json "$R/v7a_mid.json"
exit 0
