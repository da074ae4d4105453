#!/usr/bin/env bash
# H200: Nsight Compute on the decode kernels at TP1 B = 1 (warm caches, unlocked clocks, as in
# serving): GPU duration of our split and merge kernels and of upstream's SM121 kernel, and the
# warp stall breakdown, to tell launch gaps from kernel time (bench/NOTES.md, decode v4).
set -u
source "$(dirname "$0")/gpu_lib.sh"
NCU="$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
M="gpu__time_duration.sum,sm__cycles_active.avg,launch__grid_size,launch__registers_per_thread,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
step ncu_ours 150 "$NCU" --clock-control none --cache-control none --kernel-name "regex:_decode_split_kernel|_decode_merge_kernel" --launch-count 8 --metrics "$M" --csv --page raw python3 -m bench.decode_profile --ncu
step ncu_upstream 100 "$NCU" --clock-control none --cache-control none --kernel-name "regex:_qsa_split_kernel" --launch-count 2 --metrics "$M" --csv --page raw python3 -m bench.decode_profile --ncu
exit 0
