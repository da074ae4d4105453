#!/usr/bin/env bash
# session 26 call 2: memcheck of the union+rows graph test (caching allocator on: graph capture
# cannot cudaMalloc), then the wait-one branch against main
export PYTHONPATH=$PWD QSA_SGLANG_PATH=$PWD/.peer/sglang PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
mkdir -p $OUT/g9
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"
t=$SECONDS
timeout -k 5 150 "$SAN" --tool memcheck --error-exitcode 9 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_prefill_union.py -k "rows_beside_it" > $OUT/g9/memcheck_union_graph.log 2>&1; echo "memcheck rc=$? $((SECONDS-t))s"
tail -n 3 $OUT/g9/memcheck_union_graph.log
t=$SECONDS
timeout -k 5 260 python3 -m bench.prefill --mode union --sections matrix --jaccards 0.9,0.5,0.0 --rounds 8 --compare .cand/w1 --json $OUT/g9/w1_compare.json > $OUT/g9/w1.log 2>&1; echo "compare rc=$? $((SECONDS-t))s"
grep -v warn $OUT/g9/w1.log | tail -n 34
cd $OUT && tar czf g9.tgz g9 && rm -rf g9
