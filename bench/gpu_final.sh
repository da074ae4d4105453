#!/usr/bin/env bash
# H200 closing run: `qsa check --full --peer sglang` (6 shards by case-name filter, in parallel
# with the Triton decode GPU tests and compute-sanitizer memcheck of the shipped decode and of
# paged prefill calls with junk index rows; nothing
# is timed in this phase), then alone on the GPU `qsa bench decode` and `qsa bench prefill` with
# their JSON and PNG plots. Budget < 9.5 minutes; everything under $OUT/r -> $OUT/run.tar.gz.
set -u
source "$(dirname "$0")/gpu_lib.sh"
check_shards 210 decode/TP1 decode/TP2 decode/TP4 prefill/ordinary prefill/chunk prefill/paged
decode_tests_memcheck 210
# prefill: compute-sanitizer memcheck of paged calls with junk index rows (bench/prefill_memcheck.py)
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"
[ -n "$SAN" ] && { step prefill_memcheck_warm 90 python3 -m bench.prefill_memcheck && PYTORCH_NO_CUDA_MEMORY_CACHING=1 step prefill_memcheck 120 "$SAN" --tool memcheck --error-exitcode 99 python3 -m bench.prefill_memcheck; } &
wait
step bench_decode 130 python3 -m interop.cli bench decode --json "$R/bench_decode.json" --plot "$R/bench_decode.png"
# QSA_FINAL_DECODE_PASSES=2: a second, independent decode pass (small-B times move between
# graph instances); QSA_FINAL_PREFILL=0 skips the prefill bench (prefill code unchanged)
[ "${QSA_FINAL_DECODE_PASSES:-1}" -ge 2 ] && step bench_decode2 130 python3 -m interop.cli bench decode --json "$R/bench_decode2.json"
# QSA_FINAL_EXTRA="CMD": one more timed step (alone on the GPU), e.g. a decode_variants A/B
[ -n "${QSA_FINAL_EXTRA:-}" ] && step extra 200 bash -c "$QSA_FINAL_EXTRA"
[ "${QSA_FINAL_PREFILL:-1}" = 1 ] && step bench_prefill 200 python3 -m interop.cli bench prefill --no-pairs --json "$R/bench_prefill.json" --plot "$R/bench_prefill.png"
exit 0
