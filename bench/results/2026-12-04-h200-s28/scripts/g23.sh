#!/usr/bin/env bash
# session 28 call 4: tree 3c3dd68 (= 0b00f19: no output memset, tail as PDL dependent) vs 4ea690d (.cand/old): 8192-row token matrix (12/1, 24/2) and union matrix (12/1, J 0.9 / 0)
export PYTHONPATH=$PWD QSA_SGLANG_PATH=$PWD/.peer/sglang PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
mkdir -p $OUT/g23
git rev-parse HEAD > $OUT/g23/tree.txt
t=$SECONDS
timeout -k 5 250 python3 -m bench.prefill --providers ours --sections matrix --heads 12/1,24/2 --rounds 5 --compare .cand/old --json $OUT/g23/matrix_compare.json > $OUT/g23/matrix_compare.log 2>&1; echo "matrix compare rc=$? $((SECONDS-t))s"
grep -v -i warn $OUT/g23/matrix_compare.log | tail -n 9
t=$SECONDS
timeout -k 5 300 python3 -m bench.prefill --mode union --providers ours-union --sections matrix --heads 12/1 --jaccards 0.9,0.0 --rounds 5 --compare .cand/old --json $OUT/g23/union_compare.json > $OUT/g23/union_compare.log 2>&1; echo "union compare rc=$? $((SECONDS-t))s"
grep -v -i warn $OUT/g23/union_compare.log | tail -n 9
cd $OUT && tar czf g23.tgz g23 && rm -rf g23
