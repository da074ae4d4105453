#!/usr/bin/env bash
# H200 run: decode v5 code A/B (run 28 ran it with a since-removed late_trigger edit, before
# PDL_LATE was built in): PDL policies and the inline merge (bench/decode_ab.py), then the split-kernel timeline
# with 64 vs 65 splits at B = 1 (bench/decode_timeline.py). $OUT/r -> $OUT/run.tar.gz.
set -u
source "$(dirname "$0")/gpu_lib.sh"
step decode_ab 300 python3 -m bench.decode_ab --variants head,head_pdl,no_late,inline --rounds 25 --json "$R/decode_ab.json"
step decode_timeline 120 python3 -m bench.decode_timeline --cases TP1:1:64,TP1:1:65,TP2:1:64,TP2:1:65,TP2:64 --json "$R/decode_timeline.json"
exit 0
