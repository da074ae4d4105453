"""Compile every Triton kernel the prefill GPU run needs, in parallel worker processes.

Why: ``bench/gpu_prefill.sh`` must finish in 8 minutes, and one process compiles its kernels one
after another (the union pre-passes take 5-25 s each). Triton's cache key is the kernel source,
the constexprs, num_warps/stages and the 16-divisibility of integer arguments, not the sizes, so a
small call with the same head counts, head dim, W and dtypes (and, for the table geometries, a
row count in the same table bucket) compiles exactly what the big calls launch later. With
``TRITON_CACHE_DIR`` shared, the tests, the benchmark, the sweep and the memcheck then find their
kernels compiled.

Usage: ``python -m bench.prefill_warm [--workers N]`` (GPU). Prints one line per job; exit 0 even
when a job fails (the later steps report real failures).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed

# (kind, hq, hkv, rows, kv_len, kv_dtype, provider, extra); rows 1100 stands for the 8192-row
# bucket (tables change at 32/64/128/512/1024 rows), 512/128/32 for the sweep's small points.
SWEEP_GEOS = [(bn, nw, ns) for bn in (16, 32, 64) for nw in (1, 2, 4, 8) for ns in (2, 3)
              if not (ns > 2 and (bn > 32 or nw not in (2, 4)))]


def jobs() -> list[tuple]:
    out = []
    for algo in ("quads", "pairs"):  # the slow compiles first
        for kind, hq, hkv, ph in (("chunk", 12, 1, False), ("ordinary", 12, 1, False),
                                  ("paged", 12, 2, True), ("chunk", 6, 1, False),
                                  ("ordinary", 6, 1, False), ("chunk", 24, 2, False),
                                  ("ordinary", 24, 2, False), ("chunk", 12, 2, False),
                                  ("paged", 12, 2, False)):
            out.append((kind, hq, hkv, 1100, 1200, None, algo, ph))
        out.append(("chunk", 12, 1, 1100, 1200, "fp8", algo, False))
        for kind in ("chunk", "ordinary"):  # the bench's tl.sort variants
            out.append((kind, 12, 1, 1100, 1200, None, algo + "-tlsort", False))
        out.append(("paged", 12, 2, 1100, 1200, "fp8", algo, True))
    for hq, hkv in ((6, 1), (12, 1), (24, 2)):
        for kind in ("ordinary", "chunk"):
            for prov in ("ours", "upstream", "forced:64,4,2"):
                out.append((kind, hq, hkv, 1100, 1200, None, prov, False))
        for t in (32, 128, 512):
            out.append(("chunk", hq, hkv, t, t + 100, None, "ours", False))
            out.append(("chunk", hq, hkv, t, t + 100, None, "upstream", False))
    for kvd in (None, "fp8"):
        for prov in ("paged-prepass", "paged-inline"):
            out.append(("paged", 12, 1, 1100, 1200, kvd, prov, False))
            out.append(("paged", 12, 2, 65, 300, kvd, prov, True))  # memcheck: 65 rows
            out.append(("paged", 12, 2, 65, 300, kvd, prov, False))
        out.append(("chunk", 12, 1, 1100, 1200, kvd, "ours", False))
    for geo in SWEEP_GEOS:
        out.append(("chunk", 12, 1, 32, 132, None, "forced:" + ",".join(map(str, geo)), False))
    return out


def _run(job) -> tuple[str, float, str]:
    import torch  # noqa: PLC0415

    from bench.prefill import forced_provider, upstream_providers, _upstream  # noqa: PLC0415
    from bench.prefill_cases import make_case  # noqa: PLC0415

    kind, hq, hkv, rows, kv, kvd, prov, per_head = job
    t0 = time.time()
    try:
        c = make_case(kind, hq, hkv, 256, [rows], None if kind == "ordinary" else [kv],
                      kv_dtype=torch.float8_e4m3fn if kvd == "fp8" else None, per_head=per_head,
                      pool_slack=16, seed=1, device="cuda")
        if prov.split("-")[0] in ("pairs", "quads"):
            os.environ["QSA_PREFILL_ALGO"] = prov.split("-")[0]
            if prov.endswith("-tlsort"):
                os.environ["QSA_GROUP_SORT"] = "kernel"
            try:
                c.run()
            finally:
                os.environ.pop("QSA_PREFILL_ALGO", None)
                os.environ.pop("QSA_GROUP_SORT", None)
        elif prov == "ours":
            c.run()
        elif prov == "upstream":
            for fn in upstream_providers(_upstream(), c).values():
                fn()
        elif prov.startswith("forced:"):
            forced_provider(c, tuple(int(x) for x in prov[7:].split(",")))()
        elif prov.startswith("paged-"):
            import qsa_triton.prefill as P  # noqa: PLC0415

            P._paged_impl(c.q, c.k, c.v, c.slot_table, c.indices, c.cu_q, c.kv_lens, c.max_q,
                          0.0625, 1.0, 1.0, inline_slots=prov.endswith("inline"))
        torch.cuda.synchronize()
        return str(job), time.time() - t0, "ok"
    except Exception as e:  # noqa: BLE001 - reported, the later steps fail properly
        return str(job), time.time() - t0, f"{type(e).__name__}: {str(e)[:200]}\n" + \
            traceback.format_exc(limit=2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workers", type=int, default=min(8, max(1, (os.cpu_count() or 2) // 2)))
    args = ap.parse_args(argv)
    t0 = time.time()
    js = jobs()
    # spawn: CUDA cannot be forked
    import multiprocessing as mp  # noqa: PLC0415

    with ProcessPoolExecutor(max_workers=args.workers, mp_context=mp.get_context("spawn")) as ex:
        futs = [ex.submit(_run, j) for j in js]
        for f in as_completed(futs):
            name, dt, status = f.result()
            print(f"[warm] {dt:6.1f} s {status.splitlines()[0]:<10} {name}", flush=True)
            if status != "ok":
                print(status, file=sys.stderr)
    print(f"[warm] {len(js)} jobs on {args.workers} workers in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
