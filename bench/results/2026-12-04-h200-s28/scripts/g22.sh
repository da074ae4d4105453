#!/usr/bin/env bash
# session 28 call 3: + the main grid as the PDL dependent of the expansion / slot pre-pass (working tree) vs HEAD (.cand/old): GPU prefill tests; MTP compare; paged token-route compare
export PYTHONPATH=$PWD QSA_SGLANG_PATH=$PWD/.peer/sglang PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
mkdir -p $OUT/g22
t=$SECONDS
OMP_NUM_THREADS=1 timeout -k 5 200 python3 -m pytest -m gpu -q -p no:cacheprovider -n 6 tests/test_triton_prefill.py tests/test_prefill_union.py tests/test_conformance_triton.py tests/test_step.py > $OUT/g22/tests.log 2>&1; echo "tests rc=$? $((SECONDS-t))s"; tail -n 3 $OUT/g22/tests.log
t=$SECONDS
timeout -k 5 170 python3 -m bench.prefill --mode union --providers ours-union,ours-rows --sections mtp --jaccards 0.9,0.0 --rounds 10 --compare .cand/old --json $OUT/g22/mtp_compare.json > $OUT/g22/mtp_compare.log 2>&1; echo "mtp compare rc=$? $((SECONDS-t))s"
grep -v -i warn $OUT/g22/mtp_compare.log | tail -n 16
t=$SECONDS
timeout -k 5 170 python3 -m bench.prefill --providers ours --sections paged --rounds 8 --compare .cand/old --json $OUT/g22/paged_compare.json > $OUT/g22/paged_compare.log 2>&1; echo "paged compare rc=$? $((SECONDS-t))s"
grep -v -i warn $OUT/g22/paged_compare.log | tail -n 6
cd $OUT && tar czf g22.tgz g22 && rm -rf g22
