"""How fast can *any* kernel read the K/V bytes of a large-batch decode on this GPU? (issue 3)

Issue 3 asks B >= 64 saturated decode to run at >= 85% of the device-to-device copy bandwidth.
At TP2/TP4 B = 64 that is 134 MB of K + V per call, at most ~37.8 us on the H200. Our split
kernel alone takes ~38.8 us there (bench/NOTES.md, decode v4). This script measures read-only
kernels over exactly those bytes, timed the way the decode benchmark times (CUDA-graph replay of
back-to-back calls, interleaved, median), so the target can be judged against what the GPU
streams at this size rather than at the 1 GiB of the copy measurement:

  * ``dot{BN}w{W}s{S}p{P}``: P programs, each reading one contiguous share of the K and V rows in
    [BN, 256] tiles, each tile fed to a tensor-core dot (as in the decode kernel, so Triton's
    pipeliner streams the tiles through shared memory with cp.async, S stages);
  * ``dyn{T}``: persistent programs (2 per SM) taking tiles of T rows from an atomic counter
    (work stealing: no static tail), same inner loop;
  * ``copy``: ``torch`` copy of K into another buffer (reads + writes the same number of bytes);
  * ``ours``: ``qsa_triton.sparse_decode`` on the same K/V (TP2 layout: Hkv = 1, G = 12).

It also records each static program's start and end (``%globaltimer``) in one launch, to show
how much of the time is the tail (programs that finish late while others idle).

Usage (GPU): ``python -m bench.stream_ceiling [--batches 64,128] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from bench.common import copy_bandwidth_bytes_per_s, gpu_name, time_interleaved, write_json

D = 256
ROWS_PER_SEQ = 2051


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _read_rows(k_ptr, v_ptr, lo, hi, acc, ones, BN: tl.constexpr, D: tl.constexpr):
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    full = lo + ((hi - lo) // BN) * BN
    kp = k_ptr + (lo + offs_n).to(tl.int64)[:, None] * D + offs_d[None, :]
    vp = v_ptr + (lo + offs_n).to(tl.int64)[:, None] * D + offs_d[None, :]
    for _ in range(lo, full, BN):
        acc = tl.dot(ones, tl.load(kp), acc)
        acc = tl.dot(ones, tl.load(vp), acc)
        kp += BN * D
        vp += BN * D
    if full < hi:
        m = (full + offs_n) < hi
        acc = tl.dot(ones, tl.load(kp, mask=m[:, None], other=0.0), acc)
        acc = tl.dot(ones, tl.load(vp, mask=m[:, None], other=0.0), acc)
    return acc


@triton.jit
def _read_static(k_ptr, v_ptr, out_ptr, t_ptr, rows, chunk, BN: tl.constexpr, D: tl.constexpr,
                 TIMES: tl.constexpr):
    p = tl.program_id(0)
    if TIMES:
        t0 = _now()
    lo = p * chunk
    hi = tl.minimum(lo + chunk, rows)
    ones = tl.full([16, BN], 1.0, tl.bfloat16)
    acc = _read_rows(k_ptr, v_ptr, lo, hi, tl.zeros([16, D], tl.float32), ones, BN, D)
    tl.store(out_ptr + p, tl.sum(tl.sum(acc, 1), 0))
    if TIMES:
        tl.store(t_ptr + 2 * p, t0)
        tl.store(t_ptr + 2 * p + 1, _now())


@triton.jit
def _read_dynamic(k_ptr, v_ptr, out_ptr, cnt_ptr, rows, tile, n_tiles, BN: tl.constexpr,
                  D: tl.constexpr):
    p = tl.program_id(0)
    ones = tl.full([16, BN], 1.0, tl.bfloat16)
    acc = tl.zeros([16, D], tl.float32)
    t = tl.atomic_add(cnt_ptr, 1)
    while t < n_tiles:
        lo = t * tile
        acc = _read_rows(k_ptr, v_ptr, lo, tl.minimum(lo + tile, rows), acc, ones, BN, D)
        t = tl.atomic_add(cnt_ptr, 1)
    tl.store(out_ptr + p, tl.sum(tl.sum(acc, 1), 0))
    # the last program out resets the counters for the next launch (all grabs are done by then)
    if tl.atomic_add(cnt_ptr + 1, 1) == tl.num_programs(0) - 1:
        tl.atomic_xchg(cnt_ptr, 0)
        tl.atomic_xchg(cnt_ptr + 1, 0)


def _static(k, v, out, bn, warps, stages, programs):
    rows = k.shape[0]
    chunk = triton.cdiv(triton.cdiv(rows, programs), bn) * bn
    grid = (triton.cdiv(rows, chunk),)

    def fn():
        _read_static[grid](k, v, out, out, rows, chunk, BN=bn, D=D, TIMES=False,
                           num_warps=warps, num_stages=stages)
    return fn


def _dynamic(k, v, out, cnt, tile, programs):
    rows = k.shape[0]

    def fn():
        _read_dynamic[(programs,)](k, v, out, cnt, rows, tile, triton.cdiv(rows, tile), BN=32, D=D,
                                   num_warps=4, num_stages=3)
    return fn


def _spread(k, v, bn, warps, stages, programs):
    """Per-program start/end (ns) of one static launch after warm-up: the tail's share."""
    rows = k.shape[0]
    chunk = triton.cdiv(triton.cdiv(rows, programs), bn) * bn
    grid = (triton.cdiv(rows, chunk),)
    out = torch.empty(grid[0], device=k.device, dtype=torch.float32)
    t = torch.zeros(2 * grid[0], device=k.device, dtype=torch.int64)
    for _ in range(20):
        _read_static[grid](k, v, out, t, rows, chunk, BN=bn, D=D, TIMES=True, num_warps=warps,
                           num_stages=stages)
    torch.cuda.synchronize()
    tt = t.view(-1, 2).cpu().double()
    t0 = tt[:, 0].min().item()
    start, end = (tt[:, 0] - t0) / 1e3, (tt[:, 1] - t0) / 1e3  # us since the first start
    dur = end - start
    return {"programs": grid[0], "start_max_us": start.max().item(),
            "end_min_us": end.min().item(), "end_median_us": end.median().item(),
            "end_p90_us": end.quantile(0.9).item(), "end_max_us": end.max().item(),
            "dur_median_us": dur.median().item(), "dur_max_us": dur.max().item()}


def run(batches, rounds: int) -> dict:
    from bench.decode import make_inputs  # noqa: PLC0415
    from qsa_triton import sparse_decode  # noqa: PLC0415

    dev = torch.device("cuda")
    bw = copy_bandwidth_bytes_per_s(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    res = {"gpu": gpu_name(), "copy_bandwidth_Bps": bw, "sms": sms, "cases": []}
    print(f"# {res['gpu']}: copy bandwidth {bw / 1e12:.3f} TB/s (1 GiB), {sms} SMs")
    for b in batches:
        q, k, v, cq, ck, lens = make_inputs("TP2", b, "saturated", device=dev)
        rows = int(sum(lens))
        k2, v2 = k[:rows].reshape(rows, D), v[:rows].reshape(rows, D)  # Hkv = 1: [rows, D]
        nbytes = 2 * k2.numel() * k2.element_size()
        out = torch.empty(16 * sms, device=dev, dtype=torch.float32)
        cnt = torch.zeros(2, device=dev, dtype=torch.int32)
        dst = torch.empty_like(k2)
        provs = {"ours": lambda: sparse_decode(q, k, v, cq, ck, ROWS_PER_SEQ),
                 "copy": lambda: dst.copy_(k2)}
        for bn, w, s, per_sm in ((32, 4, 3, 2), (32, 4, 3, 1), (32, 4, 3, 4), (32, 4, 4, 2),
                                 (64, 4, 3, 1), (64, 8, 3, 1), (64, 8, 2, 2), (32, 8, 3, 2),
                                 (16, 4, 4, 4)):
            provs[f"dot{bn}w{w}s{s}p{per_sm}"] = _static(k2, v2, out, bn, w, s, per_sm * sms)
        for tile in (128, 256, 512):
            provs[f"dyn{tile}"] = _dynamic(k2, v2, out, cnt, tile, 2 * sms)
        t = time_interleaved(provs, rounds=rounds)
        case = {"B": b, "bytes": nbytes, "providers": {}}
        print(f"\nTP2 B={b} saturated: K+V {nbytes / 1e6:.1f} MB; 85% of copy = "
              f"{nbytes / (0.85 * bw) * 1e6:.2f} us")
        for name, r in t.items():
            if "error" in r:
                print(f"  {name:18s} ERROR {r['error']}")
                case["providers"][name] = r
                continue
            moved = nbytes  # copy: K read + K written, the same number of bytes
            pct = moved / (r["median_us"] * 1e-6) / bw * 100
            case["providers"][name] = {**r, "pct_copy": pct}
            print(f"  {name:18s} {r['median_us']:8.2f} us  p90 {r['p90_us']:8.2f}  "
                  f"{moved / r['median_us'] / 1e6:6.3f} TB/s  {pct:5.1f}% of copy")
        case["spread"] = {f"dot32w4s3p{p}": _spread(k2, v2, 32, 4, 3, p * sms) for p in (1, 2)}
        for name, sp in case["spread"].items():
            print(f"  spread {name}: " + ", ".join(f"{kk} {vv:.2f}" for kk, vv in sp.items()))
        res["cases"].append(case)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="64,128")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("stream_ceiling needs a CUDA GPU", file=sys.stderr)
        return 2
    res = run([int(x) for x in a.batches.split(",")], a.rounds)
    if a.json:
        write_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
