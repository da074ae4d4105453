#!/usr/bin/env bash
# H200 closing run: `qsa check --full --peer sglang` (6 shards by case-name filter, in parallel
# with the Triton decode GPU tests and compute-sanitizer memcheck of the shipped decode; nothing
# is timed in this phase), then alone on the GPU `qsa bench decode` and `qsa bench prefill` with
# their JSON and PNG plots. Budget < 9.5 minutes; everything under $OUT/r -> $OUT/run.tar.gz.
set -u
source "$(dirname "$0")/gpu_lib.sh"
for f in decode/TP1 decode/TP2 decode/TP4 prefill/ordinary prefill/chunk prefill/paged; do
  n=${f//\//_}
  step "check_$n" 210 python3 -m interop.cli check --full --peer sglang --filter "$f/" --json "$R/check_$n.json" &
done
step decode_gpu_tests 210 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_decode.py &
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"
[ -n "$SAN" ] && PYTORCH_NO_CUDA_MEMORY_CACHING=1 step decode_memcheck 210 "$SAN" --tool memcheck --error-exitcode 9 python3 bench/sanitize_decode.py &
wait
step bench_decode 130 python3 -m interop.cli bench decode --json "$R/bench_decode.json" --plot "$R/bench_decode.png"
step bench_prefill 200 python3 -m interop.cli bench prefill --no-pairs --json "$R/bench_prefill.json" --plot "$R/bench_prefill.png"
exit 0
