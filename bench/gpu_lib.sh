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
