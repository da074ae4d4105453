#!/usr/bin/env bash
# session 29 call 2: B = 1 paged one-chunk variants; ncu of the paged split kernel (bf16 / fp8, TP1 B = 128): stalls, pipes, memory
export PYTHONPATH=$PWD QSA_SGLANG_PATH=$PWD/.peer/sglang PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
mkdir -p $OUT/g27
t=$SECONDS
timeout -k 5 240 python3 .cand/b1bn.py > $OUT/g27/b1bn.log 2>&1; echo "b1 rc=$? $((SECONDS-t))s"
grep -E "^  |FAIL|pool/" $OUT/g27/b1bn.log
NCU="$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)"
t=$SECONDS
timeout -k 5 240 "$NCU" -k regex:_paged_split_kernel --section SpeedOfLight --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy python3 .cand/ncu29.py > $OUT/g27/ncu.log 2>&1; echo "ncu rc=$? $((SECONDS-t))s"
grep -v "^==PROF==" $OUT/g27/ncu.log | grep -E "_paged_split|Stall|Throughput|Issue|Pipe|Cycles Per|Duration|Occupancy|Bank|Shared|Warp Cycles|Executed Ipc|Active" | head -80
cd $OUT && tar czf g27.tgz g27 && rm -rf g27
