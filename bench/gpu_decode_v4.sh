#!/usr/bin/env bash
# H200 run (decode v4: cooperative merge, q row hoisted, rounded-up split boundaries; prefill
# diagnosis): `qsa check --full --peer sglang` decode shards, the Triton decode GPU tests and
# compute-sanitizer memcheck in parallel (nothing timed), then alone on the GPU the decode policy
# sweep, `qsa bench decode`, the decode profile, and Nsight Compute sections of the 8192-row
# prefill (ours vs upstream's chunk kernel). Budget < 9.7 minutes; $OUT/r -> $OUT/run.tar.gz.
set -u
source "$(dirname "$0")/gpu_lib.sh"
for f in decode/TP1 decode/TP2 decode/TP4; do
  n=${f//\//_}
  step "check_$n" 200 python3 -m interop.cli check --full --peer sglang --filter "$f/" --json "$R/check_$n.json" &
done
step decode_gpu_tests 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_decode.py &
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"
[ -n "$SAN" ] && PYTORCH_NO_CUDA_MEMORY_CACHING=1 step decode_memcheck 200 "$SAN" --tool memcheck --error-exitcode 9 python3 bench/sanitize_decode.py &
wait
step decode_variants 110 python3 -m bench.decode_variants --json "$R/decode_variants.json" --rounds 7 --variants "${VARIANTS:-v3,v4,v4_s4,v4_bn64,v4_bn64_s3,v4_bn16_s5}"
step bench_decode 80 python3 -m interop.cli bench decode --json "$R/bench_decode.json" --plot "$R/bench_decode.png"
step decode_profile 50 python3 -m bench.decode_profile --json "$R/decode_profile.json"
NCU="$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
[ -n "$NCU" ] && step prefill_ncu 140 "$NCU" --clock-control none --kernel-name "regex:_qsa_sparse_prefill_fwd|_sparse_gqa_chunk_prefill" --launch-skip 2 --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --csv --page details python3 -m bench.prefill_profile --ncu
exit 0
