#!/usr/bin/env bash
# session 28 call 5: tree 3c3dd68: the GPU suite; MTP verify vs upstream (same run)
export PYTHONPATH=$PWD QSA_SGLANG_PATH=$PWD/.peer/sglang PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
mkdir -p $OUT/g24
git rev-parse HEAD > $OUT/g24/tree.txt
t=$SECONDS
OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout -k 5 360 python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 tests > $OUT/g24/tests_gpu_suite.log 2>&1; echo "suite rc=$? $((SECONDS-t))s"; tail -n 3 $OUT/g24/tests_gpu_suite.log
t=$SECONDS
timeout -k 5 180 python3 -m bench.prefill --mode union --providers ours-union,upstream-chunk,ours-rows --sections mtp --jaccards 0.9,0.0 --rounds 10 --json $OUT/g24/mtp.json > $OUT/g24/mtp.log 2>&1; echo "mtp rc=$? $((SECONDS-t))s"
grep -v -i warn $OUT/g24/mtp.log | grep -E "union/|geomean|failed" | tail -n 24
cd $OUT && tar czf g24.tgz g24 && rm -rf g24
