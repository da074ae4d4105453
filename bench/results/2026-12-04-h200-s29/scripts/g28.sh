#!/usr/bin/env bash
# session 29 call 3: num_stages 1 / 2 where programs stream one or two chunks: paged decode (bf16, fp8) and the packed decode at B x Hkv <= 16
export PYTHONPATH=$PWD QSA_SGLANG_PATH=$PWD/.peer/sglang PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
mkdir -p $OUT/g28
t=$SECONDS
timeout -k 5 200 python3 .cand/paged_st.py bf16,fp8 > $OUT/g28/paged_st.log 2>&1; echo "paged rc=$? $((SECONDS-t))s"
grep -E "^  |FAIL|pool/" $OUT/g28/paged_st.log
t=$SECONDS
timeout -k 5 240 python3 .cand/short_st.py > $OUT/g28/short_st.log 2>&1; echo "packed rc=$? $((SECONDS-t))s"
grep -E "^  |FAIL|decode/" $OUT/g28/short_st.log
cd $OUT && tar czf g28.tgz g28 && rm -rf g28
