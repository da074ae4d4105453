"""Where the 8192-row prefill time goes (H200, issue 4): eager calls of ours and upstream's chunk
kernel on one case, for Nsight Compute.

Why: at 8192 rows ours gathers ~7.5 TB/s from L2 against upstream's ~7.1 (bench/NOTES.md, v1.3)
and issue 4 asks for 1.1x. Whether the L2 (or the load path: LSU / cp.async issue, or the
softmax ALU work) is the limit decides whether another geometry or instruction mix can still
win, or only fewer gathered bytes can. ncu's Speed-of-Light, memory and warp-state sections
answer that for both kernels on the same inputs.

Usage (GPU): ``ncu --clock-control none --kernel-name regex:"_qsa_sparse_prefill_fwd|_sparse_gqa_chunk_prefill"
--launch-skip 2 --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis
--section WarpStateStats --section Occupancy --csv --page details
python -m bench.prefill_profile --ncu [--pair 12/1] [--kv 32768] [--rows 8192]``. Without
``--ncu`` it also prints the CUDA-graph median of each provider (``bench.common.time_interleaved``).
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="12/1", help="Hq/Hkv")
    ap.add_argument("--kv", type=int, default=32768, help="context length (chunk kernel)")
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=4, help="eager calls per provider")
    ap.add_argument("--ncu", action="store_true", help="eager calls only (for ncu)")
    args = ap.parse_args(argv)
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        print("bench.prefill_profile needs a CUDA GPU", file=sys.stderr)
        return 2
    from bench.common import time_interleaved  # noqa: PLC0415
    from bench.prefill import _upstream, upstream_providers  # noqa: PLC0415
    from bench.prefill_cases import make_case  # noqa: PLC0415

    hq, hkv = (int(x) for x in args.pair.split("/"))
    c = make_case("chunk", hq, hkv, 256, [args.rows], [args.kv], seed=hq + args.kv % 1000,
                  device="cuda")
    provs = {"ours": c.run, **upstream_providers(_upstream(), c)}
    for name, fn in provs.items():
        for _ in range(args.calls):
            fn()
        torch.cuda.synchronize()
        print(f"[prefill_profile] {name}: {args.calls} eager calls", flush=True)
    if args.ncu:
        return 0
    timing = time_interleaved(provs, rounds=7)
    for name, t in timing.items():
        print(f"[prefill_profile] {name}: {t.get('median_us', float('nan')) / 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
