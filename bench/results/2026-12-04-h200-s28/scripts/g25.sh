#!/usr/bin/env bash
# session 28 call 6: tree (final prefill kernels): GPU prefill / union / conformance / step tests; compute-sanitizer memcheck of the padded and lying-metadata prefill tests
export PYTHONPATH=$PWD QSA_SGLANG_PATH=$PWD/.peer/sglang PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
mkdir -p $OUT/g25
git rev-parse HEAD > $OUT/g25/tree.txt
t=$SECONDS
OMP_NUM_THREADS=1 timeout -k 5 200 python3 -m pytest -m gpu -q -p no:cacheprovider -n 6 tests/test_triton_prefill.py tests/test_prefill_union.py tests/test_conformance_triton.py tests/test_step.py > $OUT/g25/tests_prefill_final.log 2>&1; echo "tests rc=$? $((SECONDS-t))s"; tail -n 2 $OUT/g25/tests_prefill_final.log
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"
t=$SECONDS
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 5 200 "$SAN" --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider tests/test_triton_prefill.py -k "outside_every_request or lying" > $OUT/g25/memcheck_prefill_padded_lying.log 2>&1; echo "memcheck rc=$? $((SECONDS-t))s"
grep -E "ERROR SUMMARY|passed|failed" $OUT/g25/memcheck_prefill_padded_lying.log | tail -n 3
cd $OUT && tar czf g25.tgz g25 && rm -rf g25
