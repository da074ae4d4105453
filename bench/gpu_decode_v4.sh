#!/usr/bin/env bash
# H200 run (decode v4: PDL at small B x Hkv, q row hoisted, rounded-up split boundaries; run 15
# also profiled the 8192-row prefill with ncu, PREFILL_NCU=1): `qsa check --full --peer sglang`
# decode shards, the Triton decode GPU tests and compute-sanitizer memcheck in parallel (nothing
# timed), then alone on the GPU the decode policy sweep, the decode profile and `qsa bench
# decode`. Budget < 9.7 minutes; $OUT/r -> $OUT/run.tar.gz.
set -u
source "$(dirname "$0")/gpu_lib.sh"
check_shards 200 decode/TP1 decode/TP2 decode/TP4
decode_tests_memcheck 200
wait
step decode_variants 150 python3 -m bench.decode_variants --json "$R/decode_variants.json" --rounds 7 --variants "${VARIANTS:-v3,v4,v4_pdl_all,v4_ms128_small,v4_bn16_small}"
step decode_profile 50 python3 -m bench.decode_profile --json "$R/decode_profile.json"
step bench_decode 80 python3 -m interop.cli bench decode --json "$R/bench_decode.json" --plot "$R/bench_decode.png"
[ "${PREFILL_NCU:-0}" = 1 ] || exit 0
NCU="$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
[ -n "$NCU" ] && step prefill_ncu 140 "$NCU" --clock-control none --kernel-name "regex:_qsa_sparse_prefill_fwd|_sparse_gqa_chunk_prefill" --launch-skip 2 --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --csv --page details python3 -m bench.prefill_profile --ncu
exit 0
