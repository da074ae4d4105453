"""Decode v3/v4 sweep: device-side balance and merge variants of our kernel against upstream's SM121
kernel, every shape of the issue-3 grid, one process, one set of inputs per shape.

Why a separate script: ``bench/decode.py --sweep`` varies geometry and static split counts; this
one compares whole *policies* (static plan v2 vs the balanced plan with its slot count, grid split
floor and merge mode, and PDL) on the comparison grid, so the shipped default can be chosen from
same-run ratios (bench/NOTES.md, decode v3).

Usage (GPU): ``python -m bench.decode_variants [--json PATH] [--tp TP1,TP2] [--batches 1,64]
[--rows saturated,mixed] [--variants v2,v3,...] [--rounds N]``; ``--rows`` also takes the
diagnostic kinds of ``bench.decode.EXTRA_ROWS`` (even, k1, k64, k128). Method as bench/decode.py:
CUDA-graph replay of back-to-back calls, providers interleaved, median of CUDA-event timings;
every provider checked against the FP32 reference (exit 1 past tolerance).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from bench.decode import BATCHES, D, MSK, ROWS, TP, _check, _peer_providers, _timers, make_inputs, torch_reference

#: variant -> plan_override fields (the plan is fixed per shape before timing, so graph capture
#: keeps it), plus "merge" / "pdl" for the launch. Each applies its fields on top of the current
#: defaults (decode v5: deferred row sum, one split per block at small B, PDL auto with the late
#: trigger at B x Hkv >= 64); "v4" restores decode v4 explicitly.
VARIANTS = {
    "v2": {"balance": False, "merge": "kernel", "pdl": False},
    "v4": {"defer_rowsum": False, "one_block_splits": False, "big": {"pdl": False},
           "big_kv_rows": 3},  # decode v4: power-of-two splits, per-block row sum, PDL <= 2 rows
    "v3": {"pdl": False},  # decode v3: PDL off everywhere
    "v4_pdl_all": {"pdl": True},
    "v3_s1": {"balance_slots_per_sm": 1},
    "v3_s3": {"balance_slots_per_sm": 3},
    "v3_kernel": {"merge": "kernel"},
    "v3_inline": {"merge": "inline"},
    "v3_grid2": {"grid_splits": 2},
    "v3_s1_grid2": {"balance_slots_per_sm": 1, "grid_splits": 2},
    "v3_tail": {"tail_in_loop": True},
    # B x Hkv <= 2 only: 128 splits (one BLOCK_N block each at 2051 keys), or BLOCK_N 16
    "v4_ms128_small": {"small": {"max_splits": 128}},
    "v4_bn16_small": {"small": {"max_splits": 128, "block_n": 16}},
    # K/V blocks by TMA (tensor descriptors): 31% fewer SASS instructions in the split kernel
    "v4_tma": {"tma": True},
    "v4_ptr": {"tma": False},
    # 8 warps: at B = 1 the split kernel is bound by each warp's instruction stream (ncu)
    "v4_w8_small": {"small": {"num_warps": 8}},
    "v4_w8_16": {"small": {"num_warps": 8}, "small_kv_rows": 16},
    # fewer pipeline stages where splits stream one or two blocks (less prologue code)
    "v4_s2_16": {"small": {"num_stages": 2}, "small_kv_rows": 16},
    "v4_s1_16": {"small": {"num_stages": 1}, "small_kv_rows": 16},
    # B x Hkv <= 2: 65 splits, so 2051 keys (65 blocks of 32) give every split one block; with 64
    # splits split 0 streams two and decides the kernel's time
    "v4_ms65_small": {"small": {"max_splits": 65}},
    "v4_ms65_small_tma": {"small": {"max_splits": 65}, "tma": True},
    # decode v5 loop: Q·Kᵀ as 2 or 4 independent dots over D slices (shorter dependent chain of
    # tensor-core instructions), softmax denominator reduced once after the loop
    "v5_qk2": {"qk_split": 2},
    "v5_defer": {"defer_rowsum": True},
    "v5_qk2_defer": {"qk_split": 2, "defer_rowsum": True},
    "v5_qk4_defer": {"qk_split": 4, "defer_rowsum": True},
    "v5_qk2_defer_ms65": {"qk_split": 2, "defer_rowsum": True, "small": {"max_splits": 65}},
    "v5_defer_ms65": {"defer_rowsum": True, "small": {"max_splits": 65}},
    # BLOCK_N 64 where B x Hkv >= 32 (half the per-byte barriers and reductions of BLOCK_N 32)
    "v5_defer_bn64s2": {"defer_rowsum": True, "big": {"block_n": 64, "num_stages": 2}},
    "v5_defer_bn64s3": {"defer_rowsum": True, "big": {"block_n": 64, "num_stages": 3}},
    # decode v5 as shipped (deferred row sum; PDL auto: entry trigger where B x Hkv <= 2, late
    # trigger where B x Hkv >= 64) and its alternatives at large B
    "v5": {},  # the shipped default
    "v5_early_only": {"big": {"pdl": False}, "big_kv_rows": 3},  # v4's PDL policy
    "v5_ms65": {"small": {"max_splits": 65}},
    # 4 programs' worth of splits per SM (2 resident: two waves), so the block scheduler
    # balances the tail; the grid keeps >= 8 splits per row
    "v5_s4g8": {"balance_slots_per_sm": 4, "grid_splits": 8},
    "v5_s6g16": {"balance_slots_per_sm": 6, "grid_splits": 16},
    # decode v6: the in-launch merge loads a row's partials in one round trip (INLINE_TILE), so
    # it may replace the merge kernel from fewer B x Hkv rows on (v5: inline from 66 on the H200)
    "v6": {},  # the shipped default ("v5" names the same spec: both run the current defaults)
    "v6_inl16": {"big": {"merge": "inline"}, "big_kv_rows": 16},
    "v6_inl32": {"big": {"merge": "inline"}, "big_kv_rows": 32},
    "v6_inl64": {"big": {"merge": "inline"}, "big_kv_rows": 64},
    "v6_kernel": {"merge": "kernel"},
    # TMA K/V loads where B x Hkv <= 2 only (run 21: faster at TP1 B = 1 saturated only)
    "v6_tma_small": {"small": {"tma": True}},
    # B x Hkv <= 2: BLOCK_N 64, one 64-row block per split (33 splits for 2051 keys: TP1 B = 1
    # runs 66 programs, as many as TP2 B = 1 runs with BLOCK_N 32), half the partials to merge;
    # each program does two independent 16-HMMA chains where BLOCK_N 32 does one
    "v6_bn64_small": {"small": {"block_n": 64}},
    "v6_bn64s2_small": {"small": {"block_n": 64, "num_stages": 2}},
    "v6_bn64w8_small": {"small": {"block_n": 64, "num_warps": 8}},
    # decode v6 with BLOCK_N 32 forced where B x Hkv <= 2 (v5's 65 splits at TP1 B = 1 / TP2 B = 2)
    "v6_bn32_small": {"small": {"block_n": 32}},
    # next-session probes: 128-key blocks at B x Hkv <= 2 (17 splits; 8 or 16 warps), and a
    # fourth pipeline stage where B x Hkv >= 64 (3 K/V tiles in flight per program, 2 per SM)
    "v6_bn128w8_small": {"small": {"block_n": 128, "num_warps": 8}},
    "v6_bn128w16_small": {"small": {"block_n": 128, "num_warps": 16}},
    "v6_s4_big": {"big": {"num_stages": 4}, "big_kv_rows": 64},
    # decode v7a (the L2-prefetch variants were removed with their kernel code: slower, run 39)
    "v7_pdl": {"pdl": True},  # PDL at every B (entry trigger below 64 KV rows)
    # one split (no merge kernel) where B x Hkv <= 2: with the k1 / k64 rows, one launch's cost
    "v7_ms1_small": {"small": {"max_splits": 1}},
    # B x Hkv <= 2: does the split kernel's shared memory set the call's fixed cost? (TP1 B = 1
    # runs 64-key blocks with 3 stages: ~137 KB; TP2 32-key blocks: ~73 KB)
    "v7_bn64w8s2_small": {"small": {"block_n": 64, "num_warps": 8, "num_stages": 2}},
    "v7_bn64w8s1_small": {"small": {"block_n": 64, "num_warps": 8, "num_stages": 1}},
    "v7_bn64w4s2_small": {"small": {"block_n": 64, "num_warps": 4, "num_stages": 2}},
    "v7_s2_small": {"small": {"num_stages": 2}},
    "v7_s5_small": {"small": {"num_stages": 5}},
    # decode v7b: one program per SM (balance over 1 slot per SM) with deeper pipelines where
    # B x Hkv >= 64: TP1 B = 64 then runs one split per row (no merge), TP2/TP4 B = 64 two
    "v7_s1": {"balance_slots_per_sm": 1},
    "v7_s1_st4": {"balance_slots_per_sm": 1, "big": {"num_stages": 4}, "big_kv_rows": 64},
    "v7_s1_st6": {"balance_slots_per_sm": 1, "big": {"num_stages": 6}, "big_kv_rows": 64},
    "v7_s1_st6_w8": {"balance_slots_per_sm": 1, "big": {"num_stages": 6, "num_warps": 8},
                     "big_kv_rows": 64},
    "v7_s1_st6_inl": {"balance_slots_per_sm": 1, "big": {"num_stages": 6, "merge": "inline"},
                      "big_kv_rows": 64},
    "v7_s1_st7": {"balance_slots_per_sm": 1, "big": {"num_stages": 7}, "big_kv_rows": 64},
    "v7_s1_bn64_st4": {"balance_slots_per_sm": 1,
                       "big": {"block_n": 64, "num_stages": 4, "num_warps": 8}, "big_kv_rows": 64},
    # 1.5 slots per SM: three splits per 2051-key row at B x Hkv = 64 (192 programs)
    "v7_s15": {"balance_slots_per_sm": 1.5},
    "v7_s15_st4": {"balance_slots_per_sm": 1.5, "big": {"num_stages": 4}, "big_kv_rows": 64},
}


def _plan(dec, b, hkv, g, dev, spec):
    import dataclasses  # noqa: PLC0415

    from interop.plan import next_pow2  # noqa: PLC0415

    fields = {k: v for k, v in spec.items()
              if k in ("balance", "qk_split", "defer_rowsum", "one_block_splits")}
    tma = spec.get("tma")
    if "small" in spec and b * hkv <= spec.get("small_kv_rows", 2):
        small = dict(spec["small"])
        tma = small.pop("tma", tma)
        fields.update(small)
    pdl = spec.get("pdl")
    if "big" in spec and b * hkv >= spec.get("big_kv_rows", 32):
        big = dict(spec["big"])
        pdl = big.pop("pdl", pdl)
        fields.update(big)
    with dec.plan_override(**fields):
        plan, merge = dec.plan_for(b, hkv, g, D, MSK, dev)
    sms = dec._sm_count(dev)
    if "balance_slots_per_sm" in spec:
        plan = dataclasses.replace(plan, balance_slots=round(spec["balance_slots_per_sm"] * sms))
    if "tail_in_loop" in spec:
        plan = dataclasses.replace(plan, tail_in_loop=spec["tail_in_loop"])
    if "grid_splits" in spec and plan.balance_slots:
        with dec.plan_override(balance=False):
            static, _ = dec.plan_for(b, hkv, g, D, MSK, dev)
        ms = max(static.max_splits, min(spec["grid_splits"], next_pow2(math.ceil(MSK / plan.block_n))))
        plan = dataclasses.replace(plan, max_splits=ms)
    return plan, spec.get("merge", merge), pdl, tma


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tp", default=",".join(TP))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        print(f"--variants: unknown {bad}; allowed: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    import torch  # noqa: PLC0415

    from bench.common import gpu_name, out_dir, write_json  # noqa: PLC0415
    from qsa_triton import decode as dec  # noqa: PLC0415

    if not torch.cuda.is_available():
        print("bench.decode_variants needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    dec.prepare(dev)
    time_interleaved, bw = _timers(dev)
    path = args.json or str(out_dir() / "decode_variants.json")
    res = {"gpu": gpu_name(), "copy_bandwidth_Bps": bw, "variants": {n: VARIANTS[n] for n in names},
           "cases": [], "failures": []}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for tp in args.tp.split(","):
        hq, hkv = TP[tp]
        for b in (int(x) for x in args.batches.split(",")):
            for rows in args.rows.split(","):
                t0 = time.time()
                q, k, v, cq, ck, lens = make_inputs(tp, b, rows, device=dev)
                ref = torch_reference(q, k, v, cq, ck)
                nbytes = sum(lens) * hkv * D * 2 * 2
                provs, skipped = _peer_providers(q, k, v, cq, ck, lens, D ** -0.5,
                                                 {"generic", "pallas"})
                meta = {}
                for n in names:
                    plan, merge, pdl, tma = _plan(dec, b, hkv, hq // hkv, dev, VARIANTS[n])
                    fn = (lambda plan=plan, merge=merge, pdl=pdl, tma=tma: dec.decode_with_plan(
                        q, k, v, cq, ck, MSK, plan=plan, merge=merge, pdl=pdl, tma=tma))
                    try:
                        chk = _check(fn(), ref)
                    except Exception as e:  # noqa: BLE001
                        chk = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
                    meta[n] = {"plan": plan.__dict__, "merge": merge, "pdl": pdl, "tma": tma, **chk}
                    if chk.get("ok"):
                        provs[n] = fn
                    else:
                        res["failures"].append({"tp": tp, "B": b, "rows": rows, "variant": n, **chk})
                for n in list(provs):
                    if n in meta:
                        continue
                    meta[n] = _check(provs[n](), ref)
                timing = time_interleaved(provs, rounds=args.rounds, target_replay_us=1000.0)
                base = timing.get("sm121", {}).get("median_us")
                line = []
                for n, t in timing.items():
                    meta.setdefault(n, {}).update(t)
                    us = t.get("median_us")
                    if us:
                        meta[n]["pct_copy_bw"] = 100 * nbytes / (us * 1e-6) / bw
                        if base:
                            meta[n]["speedup_vs_sm121"] = base / us
                            if n in ratios:
                                ratios[n].append(base / us)
                        line.append(f"{n} {us:.2f}")
                res["cases"].append({"tp": tp, "B": b, "rows": rows, "bytes": nbytes,
                                     "skipped": skipped, "providers": meta})
                print(f"{tp} B={b:<3d} {rows:9s} " + " | ".join(line) + f"  [{time.time() - t0:.0f}s]",
                      flush=True)
                write_json(path, {**res, "partial": True})
                del q, k, v, ref, provs
                torch.cuda.empty_cache()
    res["geomean_speedup_vs_sm121"] = {n: math.exp(sum(map(math.log, r)) / len(r))
                                       for n, r in ratios.items() if r}
    res["min_speedup_vs_sm121"] = {n: min(r) for n, r in ratios.items() if r}
    for n in names:
        if ratios[n]:
            print(f"[variants] {n:10s} geomean {res['geomean_speedup_vs_sm121'][n]:.3f}x  "
                  f"min {res['min_speedup_vs_sm121'][n]:.3f}x vs sm121")
    write_json(path, res)
    print(f"wrote {path}; failures: {res['failures'] or 'none'}")
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
