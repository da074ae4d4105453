#!/usr/bin/env bash
# H200 run for issue 7 (and the unmeasured parts of issue 4): `qsa check --full --peer sglang`
# sharded by case-name filter into parallel processes (the matrix is the same; each shard writes
# its own JSON), a GPU capture replayed on the GPU, the prefill memcheck on junk paged calls and
# the 8192-row prefill matrix with the row-group kernels and extra geometries.
# Budget: < 9.5 minutes. Everything goes to $OUT/r, tarred to $OUT/run.tar.gz at the end.
#   OUT=/path bash bench/gpu_check_full.sh [check_timeout_s]
set -u
source "$(dirname "$0")/gpu_lib.sh"
CT="${1:-300}"
T0=$SECONDS
# 1. qsa check --full --peer sglang, 6 shards in parallel (+ the prefill kernels' warm-up)
for f in decode/TP1 decode/TP2 decode/TP4 prefill/ordinary prefill/chunk prefill/paged; do
  n=${f//\//_}
  ( t=$SECONDS; timeout "$CT" python3 -m interop.cli check --full --peer sglang --filter "$f/" \
      --json "$R/check_$n.json" > "$R/check_$n.log" 2>&1; echo "check $f rc=$? $((SECONDS - t))s" >> "$R/steps.txt" ) &
done
wait
# 2. capture on the GPU (a full-matrix decode case, a quick-matrix paged case), replay here too
step capture_decode 60 python3 -m interop.cli capture --case decode/TP4/B3/medium --out "$R/cap_gpu_decode.safetensors" --model-revision "synthetic, H200 run"
step capture_paged 60 python3 -m interop.cli capture --case "prefill/paged/ragged+junk-7/G12xHkv1" --out "$R/cap_gpu_paged.safetensors" --model-revision "synthetic, H200 run"
step replay_gpu 90 python3 -m interop.cli replay --peer sglang --json "$R/replay_gpu.json" "$R"/cap_gpu_*.safetensors
# 3. memcheck: paged calls with junk index rows (issue 4)
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"
step memcheck_warm 60 python3 -m bench.prefill_memcheck
[ -n "$SAN" ] && PYTORCH_NO_CUDA_MEMORY_CACHING=1 step memcheck 70 "$SAN" --tool memcheck --error-exitcode 99 python3 -m bench.prefill_memcheck
# 4. prefill 8192-row matrix: table geometry, forced geometries, pairs/quads (time left only)
left=$((560 - (SECONDS - T0)))
[ "$left" -gt 40 ] && OUT="$R" step prefill_matrix "$left" python3 -m bench.prefill --matrix-only --no-dense --geometry 64,4,2 --geometry 64,8,2 --geometry 128,8,2 --geometry 64,4,3
exit 0
