#!/usr/bin/env bash
# One command for the H200 (issue 3): Triton decode GPU tests, compute-sanitizer memcheck, the
# comparison benchmark, the PDL on/off comparison and the geometry/split sweep. Everything is written under $OUT
# (default ./out). Budget: < 7 minutes (per-step timeouts: 180 + 90 + 120 + 90 + 150 s; expected ~5 min, then the
# optional Pallas step only in the time left). Exit status: non-zero if any step failed (all steps run).
#
#   OUT=/path/to/out bash bench/gpu_decode.sh
#
# Files: decode_gpu_tests.{log,xml}, decode_sanitizer.log, decode.{json,log},
#        decode_pdl.{json,log}, decode_sweep.{json,log}, decode_with_pallas.json + decode_pallas.log (when jax and
#        bench/pallas_decode_provider.py import), decode_env.txt, decode_steps.txt.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# triton's JIT cache on the machine's disk, shared by every step (compile once)
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
status=0
: > "$OUT/decode_steps.txt"

step() {  # step NAME LOGFILE CMD...
  local name="$1" log="$2"; shift 2
  local t0=$SECONDS
  echo "== $name: $*" | tee -a "$OUT/decode_steps.txt"
  "$@" 2>&1 | tee "$OUT/$log"
  local rc=${PIPESTATUS[0]}
  echo "-- $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/decode_steps.txt"
  [ "$rc" -eq 0 ] || status=1
}

{
  python -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'triton', triton.__version__); print(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0))"
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv 2>/dev/null || true
  git rev-parse HEAD 2>/dev/null || true
} > "$OUT/decode_env.txt" 2>&1

step "gpu tests" decode_gpu_tests.log \
  timeout 180 python -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_decode.py \
  --junitxml="$OUT/decode_gpu_tests.xml" -o junit_family=xunit2

SAN="$(command -v compute-sanitizer || ls "${CUDA_HOME:-/usr/local/cuda}"/bin/compute-sanitizer /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1 || true)"
if [ -n "$SAN" ]; then
  step "compute-sanitizer memcheck" decode_sanitizer.log \
    env PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 90 "$SAN" --tool memcheck --error-exitcode 9 \
    python bench/sanitize_decode.py
else
  echo "== compute-sanitizer not found: memcheck skipped" | tee -a "$OUT/decode_steps.txt" "$OUT/decode_sanitizer.log"
  status=1
fi

step "benchmark" decode.log timeout 120 python bench/decode.py --json "$OUT/decode.json"
# Programmatic Dependent Launch off vs on, shipped plan, every sweep shape (~30 s): the number
# that decides qsa_triton.decode.PDL_AUTO
step "pdl on/off" decode_pdl.log timeout 90 python bench/decode.py --sweep --pdl-only --json "$OUT/decode_pdl.json"
step "sweep" decode_sweep.log timeout 150 python bench/decode.py --sweep --json "$OUT/decode_sweep.json"
# last, and optional: Triton vs Pallas vs upstream on a small grid, one process, one set of inputs
# (only while the whole script stays under ~7 minutes)
if [ "$SECONDS" -lt 360 ] && python -c "import jax, bench.pallas_decode_provider" >/dev/null 2>&1; then
  step "benchmark with pallas (quick grid)" decode_pallas.log \
    timeout $((410 - SECONDS)) python bench/decode.py --quick --pallas --skip generic \
    --json "$OUT/decode_with_pallas.json"
else
  echo "== pallas comparison skipped (time used: ${SECONDS}s, or jax / provider unavailable)" \
    | tee -a "$OUT/decode_steps.txt"
fi

echo "== done: status=$status (see $OUT/decode_steps.txt)"
exit $status
