"""Per-program timeline of the decode split kernel on the GPU (issue 3, B >= 64 saturated).

Why: at TP2 B = 64 a read-only kernel with the same tiles, warps, stages and programs reads the
134 MB of K + V in 32.4 us (``bench/stream_ceiling.py``, run 25) while our split kernel alone
takes ~38.8 us. This script tells whether our programs wait for memory or for their own
instructions: it builds an instrumented copy of ``qsa_triton/decode.py`` (textual edits, as
``bench/decode_ab.py`` does) whose split kernel writes ``%globaltimer`` at entry, when the
K/V loop starts, when it ends and after the stores, per program; and a second copy whose
programs all read the *same* first K/V rows (L2-resident after the first touch: the loop's
compute-bound time at the same concurrency). Both run as CUDA-graph replays of back-to-back
calls, like the benchmark; the last replay's timestamps are kept. With PDL on (auto: B x Hkv
<= 2 or >= 64) the "entry" stamp follows the kernel's gdc_wait, so it marks when the previous
kernel's results became visible. %globaltimer ticks in steps of ~0.26 us on the H200 (run 27):
read sub-us differences per program with care.

Usage (GPU): ``python -m bench.decode_timeline [--cases TP2:64,TP1:1,TP1:1:65] [--json PATH]``
(``TP:B`` or ``TP:B:max_splits``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from bench.common import gpu_name, write_json
from bench.decode_ab import SRC, _load

_NOW = ('tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, '
        'is_pure=False, pack=1)')
_TIMED_EDITS = [
    ("cnt_ptr, cu_q_ptr, cu_k_ptr,\n    scale_log2,", "cnt_ptr, cu_q_ptr, cu_k_ptr, t_ptr,\n    scale_log2,"),
    ("    pid = tl.program_id(0)\n    # split-major order",
     f"    pid = tl.program_id(0)\n    t_0 = {_NOW}\n    # split-major order"),
    ("    m_i = tl.full([HT], float(\"-inf\"), tl.float32)\n    if DEFER_L:",
     f"    t_1 = {_NOW}\n    m_i = tl.full([HT], float(\"-inf\"), tl.float32)\n    if DEFER_L:"),
    ("    if DEFER_L:\n        l_i = tl.sum(l_i, 1)\n",
     f"    t_2 = {_NOW}\n    if DEFER_L:\n        l_i = tl.sum(l_i, 1)\n"),
    ("                tl.atomic_xchg(cnt_ptr + sh, 0, sem=\"release\", scope=\"gpu\")\n",
     "                tl.atomic_xchg(cnt_ptr + sh, 0, sem=\"release\", scope=\"gpu\")\n"
     f"    t_3 = {_NOW}\n"
     "    tl.store(t_ptr + pid * 5, t_0)\n    tl.store(t_ptr + pid * 5 + 1, t_1)\n"
     "    tl.store(t_ptr + pid * 5 + 2, t_2)\n    tl.store(t_ptr + pid * 5 + 3, t_3)\n"
     "    tl.store(t_ptr + pid * 5 + 4, tl.inline_asm_elementwise(\"mov.u32 $0, %smid;\", \"=r\", [],"
     " dtype=tl.int32, is_pure=False, pack=1).to(tl.int64))\n"),
    ("q, k_arg, v_arg, out, sc.lse, sc.part, sc.counters, cu_seqlens_q, cu_seqlens_k,",
     "q, k_arg, v_arg, out, sc.lse, sc.part, sc.counters, cu_seqlens_q, cu_seqlens_k, TBUF,"),
]
# every program streams rows [0, its block count) of the buffer (KV head h) instead of its own
# share: the bytes come from L2, so the loop runs at its compute-bound speed
_L2_EDITS = [("        row0 = k_lo.to(tl.int64) + start  # 64-bit row index into the packed K/V\n"
              "        k_ptrs = (k_ptr + h.to(tl.int64) * stride_kh + (row0 + offs_n)[:, None] * stride_kc\n"
              "                  + offs_d[None, :])\n"
              "        v_ptrs = (v_ptr + h.to(tl.int64) * stride_vh + (row0 + offs_n)[:, None] * stride_vc\n"
              "                  + offs_d[None, :])\n        if QK_SPLIT == 1:",
              "        row0 = (start * 0).to(tl.int64)\n"
              "        k_ptrs = (k_ptr + h.to(tl.int64) * stride_kh + (row0 + offs_n)[:, None] * stride_kc\n"
              "                  + offs_d[None, :])\n"
              "        v_ptrs = (v_ptr + h.to(tl.int64) * stride_vh + (row0 + offs_n)[:, None] * stride_vc\n"
              "                  + offs_d[None, :])\n        if QK_SPLIT == 1:")]


def build(where: Path) -> dict:
    src = SRC.read_text()
    mods = {}
    for name, extra in (("timed", []), ("timed_l2", _L2_EDITS)):
        text = src
        for old, new in _TIMED_EDITS + extra:
            if text.count(old) != 1:
                raise ValueError(f"decode_timeline: edit no longer matches once: {old[:60]!r}")
            text = text.replace(old, new)
        mods[name] = _load(name, text, where)
    return mods


def _summary(t: torch.Tensor, blocks: float) -> dict:
    t = t.view(-1, 5)[:, :4].double()
    t = t[t[:, 3] != 0]  # programs that ran the loop (inactive splits return early)
    if t.shape[0] == 0:
        return {"programs": 0}
    t0 = t[:, 0].min()
    rel = (t - t0) / 1e3  # us since the first program started
    q = lambda x, p: float(torch.quantile(x, p))  # noqa: E731
    start, loop, tail = rel[:, 1] - rel[:, 0], rel[:, 2] - rel[:, 1], rel[:, 3] - rel[:, 2]
    return {"programs": int(t.shape[0]), "span_us": float(rel[:, 3].max()),
            "entry_p50_us": q(rel[:, 0], .5), "entry_max_us": float(rel[:, 0].max()),
            "prologue_p50_us": q(start, .5), "loop_p50_us": q(loop, .5), "loop_p90_us": q(loop, .9),
            "loop_max_us": float(loop.max()), "epilogue_p50_us": q(tail, .5),
            "end_p10_us": q(rel[:, 3], .1), "end_p50_us": q(rel[:, 3], .5),
            "blocks_per_program": blocks, "us_per_block_p50": q(loop, .5) / max(blocks, 1)}


def run(cases, reps: int = 20) -> dict:
    from bench.decode import MSK, make_inputs  # noqa: PLC0415

    dev = torch.device("cuda")
    mods = build(Path(tempfile.mkdtemp(prefix="qsa_timeline_")))
    res = {"gpu": gpu_name(), "cases": []}
    for tp, b, ms in cases:
        q, k, v, cq, ck, lens = make_inputs(tp, b, "saturated", device=dev)
        case = {"tp": tp, "B": b, "max_splits": ms}
        for name, mod in mods.items():
            with mod.plan_override(**({"max_splits": ms} if ms else {})):
                plan, merge = mod.plan_for(b, k.shape[1], q.shape[1] // k.shape[1], q.shape[2],
                                           MSK, dev)
            n = b * k.shape[1] * plan.max_splits
            mod.TBUF = torch.zeros(5 * n, dtype=torch.int64, device=dev)  # t0..t3, SM id
            # decode_with_plan runs this module's own launch (sparse_decode would dispatch to the
            # registered torch.ops.qsa op, i.e. the uninstrumented module)
            fn = lambda m=mod, p=plan, mg=merge: m.decode_with_plan(  # noqa: E731
                q, k, v, cq, ck, MSK, plan=p, merge=mg)
            fn(), fn()
            torch.cuda.synchronize()
            nz = int((mod.TBUF != 0).sum())
            if nz == 0:  # diagnose instead of failing later
                print(f"{tp} B={b} {name}: no timestamps after eager calls (TBUF {mod.TBUF.shape}, "
                      f"plan {plan})", flush=True)
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            with torch.cuda.graph(g, stream=s):
                for _ in range(reps):
                    fn()
            for _ in range(5):
                g.replay()
            torch.cuda.synchronize()
            # active splits per row from the timestamps: blocks per program = blocks / active
            blocks = -(-MSK // plan.block_n)
            act = int((mod.TBUF.view(-1, 5)[:, 3] != 0).sum()) / max(b * k.shape[1], 1)
            case[name] = _summary(mod.TBUF.cpu(), blocks / max(act, 1))
            raw = mod.TBUF.view(-1, 5).cpu()
            live = raw[raw[:, 3] != 0]
            if live.shape[0] == 0:
                continue
            base = live[:, 0].min()
            # per program: pid, SM, start, loop start, loop end, end (ns since the first start)
            case[name]["programs_raw"] = [
                [int(i), int(r[4]), *[int(x - base) for x in r[:4]]]
                for i, r in enumerate(raw) if r[3] != 0]
            sm_load = torch.bincount(live[:, 4], minlength=int(live[:, 4].max()) + 1)
            case[name]["programs_per_sm"] = {str(c): int((sm_load == c).sum()) for c in
                                             sm_load.unique().tolist()}
            case[name]["active_splits_per_row"] = act
            print(f"{tp} B={b}{f' ms={ms}' if ms else ''} {name:9s} " + ", ".join(
                f"{kk} {vv:.2f}" if isinstance(vv, float) else f"{kk} {vv}"
                for kk, vv in case[name].items() if kk != "programs_raw"))
        res["cases"].append(case)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="TP2:64,TP4:64,TP1:64,TP1:128,TP1:1,TP1:1:64,TP2:1,TP2:1:64")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_timeline needs a CUDA GPU", file=sys.stderr)
        return 2
    # TP:B or TP:B:max_splits (a forced split count)
    cases = [(p[0], int(p[1]), int(p[2]) if len(p) > 2 else None)
             for p in (c.split(":") for c in a.cases.split(","))]
    res = run(cases)
    if a.json:
        write_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
