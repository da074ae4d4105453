#!/usr/bin/env bash
# H200 run: decode code A/B (bench/decode_ab.py; "base" = the module at the previous commit,
# carried as .peer/ab/decode_prev.py) and Nsight Compute sections of upstream's 8192-row chunk
# prefill kernel (ours was profiled in run 15). $OUT/r -> $OUT/run.tar.gz.
set -u
source "$(dirname "$0")/gpu_lib.sh"
step decode_ab 300 python3 -m bench.decode_ab --base .peer/ab/decode_prev.py --json "$R/decode_ab.json"
NCU="$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
[ -n "$NCU" ] && step prefill_ncu_upstream 120 "$NCU" --clock-control none --kernel-name "regex:_sparse_gqa_chunk_prefill" --launch-skip 1 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --csv --page details python3 -m bench.prefill_profile --ncu
exit 0
