#!/usr/bin/env bash
# H200 run (decode v7b): one program per SM with 3-6 pipeline stages at B x Hkv >= 64 against
# the shipped default (two per SM, 3 stages). $OUT/r -> run.tar.gz.
set -u
source "$(dirname "$0")/gpu_lib.sh"
step v7b 300 python3 -m bench.decode_variants --variants v6,v7_s1,v7_s1_st4,v7_s1_st6,v7_s1_st6_w8 --batches 64,128 --rounds 20 --json "$R/v7b.json"
exit 0
