"""Scratch: the Triton union build (_qsa_block_union) at 4 / 8 / 16 warps, CUDA-event timing."""
import torch
from bench import prefill as BP
from qsa_triton import prefill_union as PU
from interop.plan import next_pow2
class A: sections = "matrix"; heads = None; jaccards = "0.9"
sel = ["union/chunk/12x1/kv32k/T8192/J0.9", "union/chunk/6x1/kv32k/T8192/J0.9"]
for case in [c for c in BP.union_cases(A, "bench") if c[0].name in sel]:
    c, _ = BP.union_prepare(case, "cuda")
    g = case[0].hq // case[0].hkv
    for r in (32 // (16 if g > 8 else 8), 64 // (16 if g > 8 else 8)):
        b = c.blocks; t, nb = b.shape[0], b.shape[-1]
        n_req = c.cu_q.shape[0] - 1
        s = PU.union_slots(t, n_req, r)
        ublk, umem = (torch.empty((s, 1, r * nb), dtype=torch.int32, device="cuda") for _ in range(2))
        ulen = torch.empty((s, 1), dtype=torch.int32, device="cuda")
        maxb = int(c.kv_lens.max()) // 4 + 1
        res = {}
        for w in (4, 2, 8, 16, 32):
            def run():
                PU._qsa_block_union[(s, 1)](b, ublk, umem, ulen, c.cu_q, c.kv_lens, t, nb, n_req, maxb,
                    b.stride(0), 0, ublk.stride(0), ublk.stride(1), ulen.stride(0), 1, -1, R=r,
                    NBP=next_pow2(nb), BP=next_pow2(n_req + 1), ORDINARY=False, KEY64=False, num_warps=w)
            try:
                run(); torch.cuda.synchronize()
                ref = ulen.clone(), ublk.clone(), umem.clone()
                st, en = torch.cuda.Event(True), torch.cuda.Event(True)
                ts = []
                for rep in range(9):
                    st.record()
                    for _ in range(10): run()
                    en.record(); torch.cuda.synchronize(); ts.append(st.elapsed_time(en) * 100)
                res[w] = (min(ts), ref)
                same = all(torch.equal(a, bb) for a, bb in zip(ref, res[list(res)[0]][1])) if w != 4 else True
                print(f"{case[0].name} R={r} warps={w}: {min(ts):.1f} us per build (median {sorted(ts)[4]:.1f}), same as 4 warps: {same}")
            except Exception as e:
                print(f"{case[0].name} R={r} warps={w}: error {type(e).__name__}: {str(e)[:200]}")
