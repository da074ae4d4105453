#!/usr/bin/env bash
# The one GPU runner: every result lands under $OUT (default ./bench-out).
#
#   OUT=DIR bash bench/run_gpu.sh [STEP ...]   (default: tests check memcheck decode prefill)
#
# Steps, in the order given (their files under $OUT):
#   tests[=F,..]  pytest -m gpu over tests/, or the given files (tests.log; limit $TESTS_TIMEOUT s)
#   check         qsa check --full --peer sglang, 6 case-filter shards at once (check_*)
#   memcheck      compute-sanitizer memcheck of our kernels on the --memcheck cases (memcheck_*)
#   decode        python3 -m bench.decode, default providers (decode.{json,png,log})
#   pool          bench.decode --mode pool, TP1 saturated rows: issue 16's must-show grid with its
#                 PASS/FAIL lines (decode_pool.{json,png,log})
#   pool_sweep    paged and pallas-paged against their batch-invariant modes and upstream-step;
#                 then jax-step; then paged at 6 / 11 / 17 splits at
#                 B = 1, 4 (pool_sweep.*, pool_jax.*, pool_splits.*)
#   prefill       python3 -m bench.prefill, default providers (prefill.{json,png,log})
#   union         bench.prefill --mode union: issue 17's cases (8192-row matrix, FP8 K/V, MTP
#                 verify) at Jaccard 0.9 and 0.0, every union provider (union.{json,png,log})
#   pallas        both benchmarks with --providers ours,pallas (*_pallas.*)
#   compare=OLD   bench.decode and bench.prefill --compare OLD: the kernels of the checkout at OLD
#                 against this checkout's, per-case and geomean speedups (*_compare.*)
#   indexer[=OLD] pytest -m gpu tests/test_indexer.py (indexer_tests.log); bench.indexer decode
#                 and prefill, every provider, with the must-show lines (indexer_bench.log,
#                 indexer_{decode,prefill}.json); with OLD, --compare OLD at 32k (indexer_compare.*)
#   tp[=N]        (N >= 2 GPUs, default 2) pytest -m gpu tests/test_tp.py (tp_tests.log); qsa check
#                 --tp N --time: every rank vs TP1 and per-rank vs single-GPU time (tpN.{json,log})
# tests and check share the GPU (nothing is timed then) and run together in the background; the
# timed steps wait for them and run alone. steps.txt: "STEP rc=N Ss" per step; env.txt: versions
# and GPU. Exit status 1 if any step failed, 2 on an unknown step (before anything runs).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-bench-out}"
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
[ $# -gt 0 ] || set -- tests check memcheck decode prefill
for s in "$@"; do
  case "$s" in
    tests|tests=?*|check|memcheck|decode|prefill|union|pallas|pool|pool_sweep|indexer|tp|tp=[24]) ;;
    compare=?*|indexer=?*)
      [ -d "${s#*=}/qsa_triton" ] || { echo "run_gpu.sh: ${s#*=}/qsa_triton not found" >&2; exit 2; } ;;
    *) echo "run_gpu.sh: unknown step '$s' (see the steps at the top of $0)" >&2; exit 2 ;;
  esac
done
: > "$OUT/steps.txt"
{ git rev-parse HEAD 2>/dev/null || echo "no git metadata"
  python3 -c "import sys, torch, triton, jax; print(sys.version.split()[0], torch.__version__,
triton.__version__, jax.__version__, torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>/dev/null
} > "$OUT/env.txt" 2>&1

# step NAME LIMIT_S CMD...: CMD under a timeout, output in $OUT/NAME.log, status in steps.txt
step() {
  local name="$1" lim="$2" t=$SECONDS rc; shift 2
  # SIGKILL 10 s after the TERM: a Triton compile that hangs must not hold the GPU call
  timeout -k 10 "$lim" "$@" > "$OUT/$name.log" 2>&1; rc=$?
  echo "$name rc=$rc $((SECONDS - t))s" >> "$OUT/steps.txt"
  tail -n 4 "$OUT/$name.log" | sed "s/^/[$name] /"
}
SAN="$(command -v compute-sanitizer ||
  ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"

for s in "$@"; do
  case "$s" in
    tests|tests=*)
      files="tests"; [ "$s" = tests ] || files="${s#tests=}"
      # 8 pytest-xdist workers where installed, one BLAS thread each (the FP64 references of
      # several workers otherwise oversubscribe the CPUs): ~3 min for the whole GPU suite
      xd=""; python3 -c "import xdist" 2>/dev/null && xd="-n 8"
      OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 step tests \
        "${TESTS_TIMEOUT:-540}" python3 -m pytest -m gpu -q -p no:cacheprovider $xd \
        ${files//,/ } & ;;
    check)
      for f in decode/TP1 decode/TP2 decode/TP4 prefill/ordinary prefill/chunk prefill/paged; do
        step "check_${f//\//_}" 420 python3 -m interop.validate.cli check --full --peer sglang \
          --filter "$f/" --json "$OUT/check_${f//\//_}.json" &
      done ;;
    memcheck)
      wait
      if [ -z "$SAN" ]; then
        echo "memcheck rc=127 0s (compute-sanitizer not found)" >> "$OUT/steps.txt"; continue
      fi
      for b in decode prefill pool; do
        # compile outside the sanitizer first (compiles are slow under it); without torch's
        # caching allocator every tensor is its own allocation, so a stray read is reported
        args=(-m "bench.$b" --memcheck --providers ours --json "$OUT/memcheck_$b.json")
        [ "$b" = pool ] && args=(-m bench.decode --mode pool --memcheck --providers \
          "paged,paged[bi]" --json "$OUT/memcheck_$b.json")
        step "memcheck_${b}_warm" 200 python3 "${args[@]}"
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 step "memcheck_$b" 300 "$SAN" --tool memcheck \
          --error-exitcode 9 python3 "${args[@]}"
      done ;;
    decode|prefill)
      wait
      step "$s" 420 python3 -m "bench.$s" --json "$OUT/$s.json" --plot "$OUT/$s.png" ;;
    union)
      wait
      step union 540 python3 -m bench.prefill --mode union --sections matrix,fp8,mtp \
        --jaccards 0.9,0.0 --rounds 5 --json "$OUT/union.json" --plot "$OUT/union.png" ;;
    pool)
      wait
      step decode_pool 420 python3 -m bench.decode --mode pool --tp TP1 --rows saturated \
        --json "$OUT/decode_pool.json" --plot "$OUT/decode_pool.png" ;;
    pool_sweep)
      wait
      step pool_sweep 300 python3 -m bench.decode --mode pool --tp TP1 --rows saturated \
        --batches 1,16,128 --providers \
        "upstream-step,paged,paged[bi],pallas-paged,pallas-paged[bi]" \
        --json "$OUT/pool_sweep.json"
      step pool_jax 100 python3 -m bench.decode --mode pool --tp TP1 --rows saturated \
        --layouts slots --kv bf16 --batches 1,16,128 --providers \
        "upstream-step,jax-step,pallas-paged" --json "$OUT/pool_jax.json"
      step pool_splits 150 python3 -m bench.decode --mode pool --tp TP1,TP2 --rows saturated \
        --layouts slots --kv bf16 --batches 1,4 --providers \
        "upstream-step,paged,paged[s6],paged[s11],paged[s17]" --json "$OUT/pool_splits.json" ;;
    pallas)
      wait
      for b in decode prefill; do
        step "${b}_pallas" 420 python3 -m "bench.$b" --providers ours,pallas \
          --json "$OUT/${b}_pallas.json" --plot "$OUT/${b}_pallas.png"
      done ;;
    compare=*)
      wait
      old="${s#compare=}"
      step decode_compare 420 python3 -m bench.decode --compare "$old" --rounds 25 \
        --json "$OUT/decode_compare.json"
      step prefill_compare 420 python3 -m bench.prefill --compare "$old" \
        --json "$OUT/prefill_compare.json" ;;
    indexer|indexer=*)
      wait
      step indexer_tests 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_indexer.py
      # prefill first (one case): a decode sweep cut short by the limit keeps it (and the JSON
      # keeps every finished case)
      step indexer_bench 300 sh -c 'python3 -m bench.indexer --mode prefill --rounds 5 \
        --json "$OUT/indexer_prefill.json"; a=$?; python3 -m bench.indexer --mode decode \
        --rounds 10 --json "$OUT/indexer_decode.json"; exit $((a | $?))'
      grep -A20 "^must-show" "$OUT/indexer_bench.log"
      [ "$s" = indexer ] || step indexer_compare 110 python3 -m bench.indexer \
        --compare "${s#indexer=}" --contexts 32768 --rounds 10 \
        --json "$OUT/indexer_compare.json" ;;
    tp|tp=*)
      wait
      n="${s#tp}"; n="${n#=}"; n="${n:-2}"
      step tp_tests 500 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_tp.py
      step "tp$n" 500 python3 -m interop.validate.cli check --tp "$n" --time \
        --json "$OUT/tp$n.json" ;;
  esac
done
wait
echo "total ${SECONDS}s" >> "$OUT/steps.txt"
cat "$OUT/steps.txt"
! grep -q "rc=[1-9]" "$OUT/steps.txt"
