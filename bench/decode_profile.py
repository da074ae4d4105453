"""Where the decode time goes at small and mid batch (H200): graph-replay time of the full call,
of the split kernel alone (merge launch left out: output not checked, timing only), and of an
empty Triton kernel (the per-launch floor of a CUDA-graph node), for our shipped plan and
upstream's SM121 kernel.

Why: issue 3's B = 1 target (<= 0.5x upstream's time) and the B = 64 copy-bandwidth target were
missed by configuration sweeps (bench/NOTES.md, decode v3); this separates launch floor, split
kernel and merge so the next design (one launch? fewer splits?) is chosen from numbers.

Usage (GPU): ``python -m bench.decode_profile [--json PATH]``; under ``ncu`` (``ncu
--clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum
python -m bench.decode_profile --ncu``) it runs each provider a few times eagerly instead.
"""

from __future__ import annotations

import argparse
import sys

SHAPES = [("TP1", 1, "saturated"), ("TP2", 1, "saturated"), ("TP2", 64, "saturated"),
          ("TP4", 64, "saturated"), ("TP1", 64, "saturated"), ("TP2", 128, "saturated")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--ncu", action="store_true", help="eager calls only (for ncu)")
    args = ap.parse_args(argv)
    import torch  # noqa: PLC0415
    import triton  # noqa: PLC0415
    import triton.language as tl  # noqa: PLC0415

    from bench.common import gpu_name, out_dir, time_interleaved, write_json  # noqa: PLC0415
    from bench.decode import MSK, TP, _peer_providers, make_inputs  # noqa: PLC0415
    from qsa_triton import decode as dec  # noqa: PLC0415

    @triton.jit
    def _empty(x_ptr, n):
        pid = tl.program_id(0)
        if pid > n:  # never true: keeps the launch real and the kernel empty
            tl.store(x_ptr, 0)

    dev = torch.device("cuda")
    dec.prepare(dev)
    dummy = torch.zeros(1, device=dev)

    class _NoLaunch:
        def __getitem__(self, grid):
            return lambda *a, **k: None

    res = {"gpu": gpu_name(), "cases": []}
    for tp, b, rows in SHAPES:
        hq, hkv = TP[tp]
        q, k, v, cq, ck, lens = make_inputs(tp, b, rows, device=dev)
        plan, merge = dec.plan_for(b, hkv, hq // hkv, 256, MSK, dev)
        full = lambda: dec.decode_with_plan(q, k, v, cq, ck, MSK, plan=plan, merge=merge)  # noqa: E731
        real_merge = dec._decode_merge_kernel

        def split_only():
            dec._decode_merge_kernel = _NoLaunch()
            try:
                return dec.decode_with_plan(q, k, v, cq, ck, MSK, plan=plan, merge=merge)
            finally:
                dec._decode_merge_kernel = real_merge

        grid = b * hkv * plan.max_splits
        empty = lambda: _empty[(grid,)](dummy, grid)  # noqa: E731
        kk, vv = k[: int(ck[-1])], v[: int(ck[-1])]
        # the same K/V bytes through torch's own reduction kernels (two launches): what a
        # vendor read-only kernel reaches on exactly these bytes
        read_only = lambda: (kk.sum(dtype=torch.float32), vv.sum(dtype=torch.float32))  # noqa: E731
        provs = {"full": full, "split_only": split_only, "empty_kernel": empty,
                 "torch_sum_kv": read_only}
        peer, _ = _peer_providers(q, k, v, cq, ck, lens, 256 ** -0.5, {"generic", "pallas"})
        provs.update(peer)
        if args.ncu:
            for fn in provs.values():
                for _ in range(3):
                    fn()
            torch.cuda.synchronize()
            continue
        t = time_interleaved(provs, rounds=9, target_replay_us=1000.0)
        line = {n: round(x["median_us"], 2) for n, x in t.items() if "median_us" in x}
        nbytes = sum(lens) * hkv * 256 * 2 * 2  # K + V rows read
        tbps = {n: round(nbytes / (us * 1e-6) / 1e12, 2) for n, us in line.items()
                if n != "empty_kernel"}
        print(f"{tp} B={b} {rows}: plan splits={plan.max_splits} merge={merge} | us {line} | "
              f"K+V TB/s {tbps}", flush=True)
        res["cases"].append({"tp": tp, "B": b, "rows": rows, "plan": plan.__dict__, "merge": merge,
                             "us": line, "kv_bytes": nbytes, "kv_tbps": tbps})
    if not args.ncu:
        path = write_json(args.json or out_dir() / "decode_profile.json", res)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
