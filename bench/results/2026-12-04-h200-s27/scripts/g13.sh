#!/usr/bin/env bash
# session 27 call 1: Pallas i32-cols branch vs main (per-row matrix); FP8 paged sweep; ncu of FP8 vs BF16
export PYTHONPATH=$PWD QSA_SGLANG_PATH=$PWD/.peer/sglang PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
mkdir -p $OUT/g13
t=$SECONDS
timeout -k 5 150 python3 .cand/fp8sweep.py 12 16,64,128 TP1,TP2 > $OUT/g13/fp8sweep.log 2>&1; echo "fp8sweep rc=$? $((SECONDS-t))s"
grep -v -i warn $OUT/g13/fp8sweep.log | grep "  TP" | head -40
t=$SECONDS
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
timeout -k 5 120 $NCU -k regex:_paged_split_kernel --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats --section LaunchStats python3 .cand/fp8ncu.py > $OUT/g13/ncu.log 2>&1; echo "ncu rc=$? $((SECONDS-t))s"
grep -E "Duration|Issue Slots Busy|Eligible Warps|Active Warps Per|Achieved Occupancy|Registers Per|Theoretical Occupancy|Memory Throughput|DRAM Throughput|Stall|No Eligible|One or More|Warp Cycles Per Issued|Block Limit" $OUT/g13/ncu.log | head -60
t=$SECONDS
timeout -k 5 200 python3 -m bench.prefill --providers pallas --sections matrix --rounds 8 --compare .cand/old --json $OUT/g13/rows_compare.json > $OUT/g13/rows_compare.log 2>&1; echo "rows compare rc=$? $((SECONDS-t))s"
grep -v -i warn $OUT/g13/rows_compare.log | tail -n 14
cd $OUT && tar czf g13.tgz g13 && rm -rf g13
