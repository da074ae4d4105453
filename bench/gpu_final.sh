#!/usr/bin/env bash
# H200 closing run: `qsa check --full --peer sglang` (6 shards by case-name filter, in parallel
# with the Triton decode GPU tests and compute-sanitizer memcheck of the shipped decode; nothing
# is timed in this phase), then alone on the GPU `qsa bench decode` and `qsa bench prefill` with
# their JSON and PNG plots. Budget < 9.5 minutes; everything under $OUT/r -> $OUT/run.tar.gz.
set -u
source "$(dirname "$0")/gpu_lib.sh"
check_shards 210 decode/TP1 decode/TP2 decode/TP4 prefill/ordinary prefill/chunk prefill/paged
decode_tests_memcheck 210
wait
step bench_decode 130 python3 -m interop.cli bench decode --json "$R/bench_decode.json" --plot "$R/bench_decode.png"
step bench_prefill 200 python3 -m interop.cli bench prefill --no-pairs --json "$R/bench_prefill.json" --plot "$R/bench_prefill.png"
exit 0
