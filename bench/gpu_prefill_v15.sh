#!/usr/bin/env bash
# H200 run: prefill v1.5 A/B (deferred row sum vs the per-tile row sum, same process) on the
# 8192-row matrix, then the Triton prefill GPU tests. $OUT/r -> $OUT/run.tar.gz.
set -u
source "$(dirname "$0")/gpu_lib.sh"
OUT="$R" step prefill_ab 200 python3 -m bench.prefill --matrix-only --no-dense --no-pairs --providers ours,ours-rowsum,upstream-ordinary,upstream-chunk
step prefill_gpu_tests 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_prefill.py
exit 0
