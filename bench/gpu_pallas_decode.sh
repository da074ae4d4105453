#!/usr/bin/env bash
# The one command the lead runs on the H200 for the Pallas decode (issue 5):
#   OUT=/path/to/results bash bench/gpu_pallas_decode.sh [fair|all|tests|lowering|timing|compare]
#   (default: fair = tests + compare, expected < 4 min on the H200)
# tests    : `-m gpu` of tests/test_pallas_decode.py + tests/test_cross_decode.py: the decode shape
#            suite (B in 1,3,4,16,17,32,48,64,128 x short/medium/saturated x TP1/TP2/TP4, bf16,
#            D=256, one K/V capacity per TP -> 1 decode compile per (B, TP), second run bitwise
#            equal, no recompile for new lengths), replay with new lengths, Pallas vs Triton vs
#            reference (B in 1,16,128 x saturated/mixed) through interop.dlpack. Expected ~60-90 s.
#            -> $OUT/pallas_decode_tests.{xml,log}
#            (`all`: also the CPU-marked value tests of both files, compiled for the GPU.)
# lowering : tests/test_pallas_lowering.py (CPU-style AOT lowering; jax 0.11.2 device kinds).
# compare  : bench/decode.py --pallas --skip generic: Triton (CUDA-graph replay) vs Pallas
#            (one jitted call of N >= 64 chained decodes, wall time / N; see
#            bench/pallas_decode_provider.py "Timing JAX work") -> $OUT/decode_fair.{json,log}
# timing   : Pallas-only matrix (+ the one-launch `direct` variant on one-split plans, + JAX
#            context peers) -> $OUT/pallas_decode.json, $OUT/pallas_decode_timing.log
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

MODE="${1:-fair}"
case "$MODE" in
  fair|all|tests|lowering|timing|compare) ;;
  *) echo "usage: OUT=dir bash bench/gpu_pallas_decode.sh [fair|all|tests|lowering|timing|compare]" >&2
     exit 2 ;;
esac
has() { [ "$MODE" = "$1" ] || [ "$MODE" = all ] || { [ "$MODE" = fair ] && { [ "$1" = tests ] || [ "$1" = compare ]; }; }; }
rc_tests=0
rc_bench=0
rc_cmp=0
if has tests; then
SECONDS=0
MARK=gpu; TLIM=170
# `all` also runs the CPU-marked value tests (edge lengths 0/1/BLOCK_N+-1, poison, errors) compiled
# for the GPU: slower (one compile each), not part of the < 120 s budget
if [ "$MODE" = all ]; then MARK="gpu or not gpu"; TLIM=400; fi
timeout "$TLIM" python3 -m pytest -q -m "$MARK" -p no:cacheprovider --durations=15 \
    tests/test_pallas_decode.py tests/test_cross_decode.py \
    --junitxml="$OUT/pallas_decode_tests.xml" 2>&1 | tee "$OUT/pallas_decode_tests.log"
rc_tests=${PIPESTATUS[0]}
echo "gpu tests: ${SECONDS}s" | tee -a "$OUT/pallas_decode_tests.log"
fi

if has lowering; then
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_pallas_lowering.py 2>&1 \
    | tee "$OUT/pallas_lowering_tests.log"
rc_tests=$(( rc_tests | PIPESTATUS[0] ))
fi

if has compare; then
SECONDS=0
timeout 300 python3 bench/decode.py --pallas --skip generic --json "$OUT/decode_fair.json" \
    2>&1 | tee "$OUT/decode_fair.log"
rc_cmp=${PIPESTATUS[0]}
echo "compare: ${SECONDS}s" | tee -a "$OUT/decode_fair.log"
# Pallas / Triton speed ratio (issue target: geomean >= 0.85; B>=64 saturated >= 75% copy bw)
python3 - "$OUT/decode_fair.json" <<'PY' 2>&1 | tee -a "$OUT/decode_fair.log"
import json, math, sys
d = json.load(open(sys.argv[1]))
print("timing method:", d.get("method"), "| pallas:", "one jitted call of N chained decodes "
      "(N = providers.pallas.inner_reps, >= 64), CUDA events around the call / N; triton: CUDA graph")
rat, sat = [], []
for c in d["cases"]:
    p, o = c["providers"].get("pallas", {}), c["providers"].get("ours", {})
    if "median_us" in p and "median_us" in o:
        r = o["median_us"] / p["median_us"]
        rat.append(r)
        print(f"{c['tp']} B={c['B']:3d} {c['rows']:9s} triton {o['median_us']:7.2f} us  pallas "
              f"{p['median_us']:7.2f} us (N={p.get('inner_reps')})  speed ratio {r:.3f}  "
              f"pallas {p.get('pct_copy_bw', float('nan')):5.1f}% copy bw")
        if c["B"] >= 64 and c["rows"] == "saturated":
            sat.append(p.get("pct_copy_bw", float("nan")))
if rat:
    print(f"geomean pallas/triton speed ratio {math.exp(sum(map(math.log, rat)) / len(rat)):.3f} "
          f"(min {min(rat):.3f}) over {len(rat)} cases; B>=64 saturated pallas %copy bw "
          f"{min(sat, default=float('nan')):.1f}..{max(sat, default=float('nan')):.1f}")
PY
fi

if has timing; then
timeout 560 python3 -m bench.pallas_decode_provider --json "$OUT/pallas_decode.json" 2>&1 \
    | tee "$OUT/pallas_decode_timing.log"
rc_bench=${PIPESTATUS[0]}
fi

echo "gpu_pallas_decode ($MODE): tests rc=$rc_tests, compare rc=$rc_cmp, timing rc=$rc_bench" \
    | tee -a "$OUT/pallas_decode_summary.log"
[ "$rc_tests" -eq 0 ] && [ "$rc_bench" -eq 0 ] && [ "$rc_cmp" -eq 0 ]
