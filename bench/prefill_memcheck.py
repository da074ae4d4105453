"""Paged sparse prefill call for ``compute-sanitizer --tool memcheck`` (issue 4).

Index rows carry junk after the valid prefix (-1, -7, len, len+19 and int32 extremes:
``interop.indices`` junk mode "mixed"), the slot table holds slots far past the pool for every
position >= kv_len (read only if an invalid entry were dereferenced), unselected pool rows hold NaN.
Runs bf16 and FP8 pools, shared [T, W] and per-head [T, Hkv, W] indices, pre-pass and inline slot
resolution, plus the ordinary and chunk variants, and checks every output against the float32
reference. Run it under the sanitizer with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` so each tensor
is its own allocation and an out-of-bounds read is reported instead of landing in a cached block.

Exit status: 0 when every output is within tolerance, 1 otherwise (the sanitizer adds its own).
"""

from __future__ import annotations

import sys

import torch

from bench.prefill_cases import errors, make_case, reference_f32, within_tolerance


def main() -> int:
    import qsa_triton.prefill as P  # noqa: PLC0415

    bad = []
    for kv_dtype in (None, torch.float8_e4m3fn):
        for per_head in (False, True):
            c = make_case("paged", 12, 2, 256, [40, 25], [300, 2100], width=2051, junk="mixed",
                          per_head=per_head, kv_dtype=kv_dtype, nan_unselected=True,
                          table_junk=True, pool_slack=64, k_scale=1.0 if kv_dtype is None else 0.7,
                          v_scale=1.0 if kv_dtype is None else 1.3, seed=31, device="cuda")
            ref = reference_f32(c)
            for inline in (False, True):
                out = P._paged_impl(c.q, c.k, c.v, c.slot_table, c.indices, c.cu_q, c.kv_lens,
                                    c.max_q, 256 ** -0.5, c.k_scale, c.v_scale,
                                    inline_slots=inline)
                torch.cuda.synchronize()
                err = errors(out.float(), ref)
                tag = f"paged kv={c.k.dtype} per_head={per_head} inline={inline}"
                print(tag, err, flush=True)
                if not within_tolerance(err):
                    bad.append(tag)
            out = c.run()  # public entry point (contract check + custom op)
            torch.cuda.synchronize()
            if not within_tolerance(errors(out.float(), ref)):
                bad.append(f"public paged per_head={per_head}")
    # the experimental pair/quad kernels (scatter stores in their pre-passes): every variant
    import os  # noqa: PLC0415

    try:
        # (variants bench/prefill_warm.py compiled; odd row counts leave partial groups)
        for algo in ("pairs", "quads"):
            os.environ["QSA_PREFILL_ALGO"] = algo
            for kind, kv, per_head in (("paged", [300, 2100], True),
                                       ("chunk", [300, 2100], False), ("ordinary", None, False)):
                c = make_case(kind, 12, 2, 256, [41, 26], kv, width=2051, junk="mixed",
                              per_head=per_head, nan_unselected=True, table_junk=kind == "paged",
                              pool_slack=64, seed=33, device="cuda")
                out = c.run()
                torch.cuda.synchronize()
                err = errors(out.float(), reference_f32(c))
                print(algo, kind, per_head, err, flush=True)
                if not within_tolerance(err):
                    bad.append(f"{algo} {kind} per_head={per_head}")
    finally:
        os.environ.pop("QSA_PREFILL_ALGO", None)
    for kind, kv in (("ordinary", None), ("chunk", [300, 2100])):
        c = make_case(kind, 6, 1, 256, [40, 25], kv, width=2051, junk="mixed",
                      nan_unselected=True, seed=32, device="cuda")
        out = c.run()
        torch.cuda.synchronize()
        err = errors(out.float(), reference_f32(c))
        print(kind, err, flush=True)
        if not within_tolerance(err):
            bad.append(kind)
    print("memcheck cases past tolerance:", bad or "none")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
