#!/usr/bin/env bash
# H200 run (decode v7c): B x Hkv = 64 variants after v7b: one program per SM with 6/7 stages
# (merge kernel or inline), 64-key blocks, three splits per row. $OUT/r -> run.tar.gz.
set -u
source "$(dirname "$0")/gpu_lib.sh"
step v7c 300 python3 -m bench.decode_variants --variants v6,v7_s1_st6,v7_s1_st6_inl,v7_s1_st7,v7_s1_bn64_st4,v7_s15,v7_s15_st4 --batches 64 --rounds 20 --json "$R/v7c.json"
exit 0
