#!/usr/bin/env bash
# The one command the lead runs on the H200 for the Pallas decode (issue 5):
#   OUT=/path/to/results bash bench/gpu_pallas_decode.sh [all|tests|timing]   (default: all)
# Expected wall time on the H200: tests ~4-6 min (69 suite compiles), timing ~3-4 min; run the two
# halves as separate calls if one call is limited to 10 minutes.
# 1. GPU tests: the decode shape suite (every B in 1..16, 17, 24, 32, 48, 64, 96, 128 x short /
#    medium / saturated x TP1/TP2/TP4, bf16, D=256, second run bitwise equal, no recompilation for
#    new lengths), replay with new lengths, Pallas vs Triton vs reference through interop.dlpack;
#    plus the CPU-style lowering tests (jax 0.11.2 maps abstract device kinds to sm_90/120/121).
#    -> $OUT/pallas_decode_tests.xml, $OUT/pallas_decode_tests.log
# 2. Pallas-only timing: TP1/TP2/TP4 x B in {1,4,16,32,64,128} x {saturated, mixed}, with JAX's
#    deprecated Pallas gqa and jax.nn.dot_product_attention (xla, cudnn) on gathered K/V as
#    context; % of measured copy bandwidth. -> $OUT/pallas_decode.json, $OUT/pallas_decode_timing.log
# (The Triton-vs-Pallas ratio is measured by bench/decode.py, which imports
#  bench/pallas_decode_provider.make_provider.)
# Exit status: non-zero if any test failed or any timed case was wrong.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"
mkdir -p "$OUT"
export OUT
# jax must not grab 75% of the GPU up front: torch (Triton side, reference tensors) shares it.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-1}"

python3 - <<'PY' 2>&1 | tee "$OUT/pallas_decode_env.log"
import jax, sys
print("python", sys.version.split()[0], "| jax", jax.__version__, "| backend", jax.default_backend(),
      "|", [d.device_kind for d in jax.devices()])
try:
    import torch, triton
    print("torch", torch.__version__, "| triton", triton.__version__, "| cuda", torch.cuda.is_available())
except ImportError as e:
    print("torch/triton missing:", e)
PY

MODE="${1:-all}"
case "$MODE" in
  all|tests|timing) ;;
  *) echo "usage: OUT=dir bash bench/gpu_pallas_decode.sh [all|tests|timing]" >&2; exit 2 ;;
esac
rc_tests=0
rc_bench=0
if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
timeout 560 python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider \
    tests/test_pallas_decode.py tests/test_cross_decode.py tests/test_pallas_lowering.py \
    --junitxml="$OUT/pallas_decode_tests.xml" 2>&1 | tee "$OUT/pallas_decode_tests.log"
rc_tests=${PIPESTATUS[0]}
fi

if [ "$MODE" = all ] || [ "$MODE" = timing ]; then
timeout 560 python3 -m bench.pallas_decode_provider --json "$OUT/pallas_decode.json" 2>&1 \
    | tee "$OUT/pallas_decode_timing.log"
rc_bench=${PIPESTATUS[0]}
fi

echo "gpu_pallas_decode ($MODE): tests rc=$rc_tests, timing rc=$rc_bench" | tee -a "$OUT/pallas_decode_summary.log"
[ "$rc_tests" -eq 0 ] && [ "$rc_bench" -eq 0 ]
