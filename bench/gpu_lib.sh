# Shared set-up of the one-call H200 scripts (sourced): results under $OUT/r, tarred to
# $OUT/run.tar.gz on exit (the device returns at most 8 files), `step NAME LIMIT CMD...` runs
# CMD with a timeout, its output in $R/NAME.log and "NAME rc=.. Ns" in $R/steps.txt.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-out}"; R="$OUT/r"; mkdir -p "$R"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton-cache}"
finish() { echo "total ${SECONDS}s" >> "$R/steps.txt"; tar -czf "$OUT/run.tar.gz" -C "$OUT" r; }
trap finish EXIT
step() { local n="$1" lim="$2"; shift 2; local t=$SECONDS; timeout "$lim" "$@" > "$R/$n.log" 2>&1; echo "$n rc=$? $((SECONDS - t))s" >> "$R/steps.txt"; }
{ git rev-parse HEAD; python3 -c "import torch, triton, jax; print(torch.__version__, triton.__version__, jax.__version__, torch.cuda.get_device_name())"; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv; } > "$R/env.txt" 2>&1
# `check_shards LIMIT FILTER...`: one `qsa check --full --peer sglang --filter FILTER/` per filter,
# each a background step named check_<filter with / -> _> (JSON beside its log); `wait` for them.
check_shards() { local lim="$1" f; shift; for f in "$@"; do step "check_${f//\//_}" "$lim" python3 -m interop.cli check --full --peer sglang --filter "$f/" --json "$R/check_${f//\//_}.json" & done; }
# `decode_tests_memcheck LIMIT`: the Triton decode GPU tests and compute-sanitizer memcheck of
# bench/sanitize_decode.py (skipped without compute-sanitizer), both in the background.
decode_tests_memcheck() {
  local lim="$1" san
  step decode_gpu_tests "$lim" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_decode.py &
  san="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"
  [ -n "$san" ] && PYTORCH_NO_CUDA_MEMORY_CACHING=1 step decode_memcheck "$lim" "$san" --tool memcheck --error-exitcode 9 python3 bench/sanitize_decode.py &
}
