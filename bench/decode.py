"""Decode benchmark: packed varlen sparse decode (``qsa-contract.md`` §2), ours against upstream
SGLang 0.5.23's kernels and our Pallas twin, on the H200.

  python3 -m bench.decode [--providers A,B,..] [--tp ..] [--batches ..] [--rows ..]
                          [--json F] [--plot F.png]          time and check (GPU)
  python3 -m bench.decode --smoke-cpu                        code paths on CPU, no timing
  python3 -m bench.decode --memcheck                         edge cases for compute-sanitizer
  python3 -m bench.decode --compare OLD_TREE                 this checkout vs another commit's

Cases (``interop.cases``): TP1 (24/2), TP2 (12/1), TP4 (6/1) x B in ``BENCH_DECODE_BATCHES`` x
rows ``BENCH_DECODE_ROWS`` (saturated: 2051 keys per row; mixed: 17..2051; short: 1..64), D = 256,
bf16, max_seqlen_k = 2051, K/V exactly as long as the rows. Bytes = the K and V rows the case
reads; % copy = those bytes per second over the copy bandwidth measured in the same run.
Timing (``bench.common``): CUDA-graph replays of 20 back-to-back calls; Pallas as an unrolled chain
of 20 calls in one ``jax.jit``, each call's q the previous output.

Modes (``MODES``; ``--mode`` chooses once there is more than one): ``packed``, the decode of
packed K/V. A mode is a ``bench.common.Mode``: its cases, inputs, FP32 reference, bytes and
provider registry; a decode reading the KV pool in place is another entry with its own.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from bench import common
from interop import cases as C

__all__ = ["DecodeInputs", "make_inputs", "torch_reference", "PROVIDERS", "PACKED", "MODES",
           "main"]

D, CHAIN = 256, 20


@dataclasses.dataclass
class DecodeInputs:
    """One packed decode batch on the device: the entry point's arguments and the row lengths."""

    q: Any
    k: Any
    v: Any
    cu_q: Any
    cu_k: Any
    max_seqlen_k: int
    scale: float | None
    lens: list[int]

    @property
    def args(self) -> list:
        return [self.q, self.k, self.v, self.cu_q, self.cu_k, self.max_seqlen_k, self.scale]


def make_inputs(spec: C.DecodeSpec, device) -> DecodeInputs:
    """Seeded inputs of a ``DecodeSpec`` on ``device``: lengths from
    ``interop.indices.decode_lengths``, q/K/V N(0, 1) in the spec's dtype, generated on the device;
    K/V rows = sum of lengths + ``slack`` (or B x max_len + slack with ``pad_capacity``), the
    slack NaN when ``poison``."""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415

    from interop import indices as I  # noqa: PLC0415

    lens = I.decode_lengths(spec.batch, spec.pattern, max_len=spec.max_len, seed=spec.seed,
                            zero_rows=spec.zero_rows)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cap = (spec.batch * spec.max_len if spec.pad_capacity else int(cu[-1])) + spec.slack
    g = torch.Generator(device=device).manual_seed(1000 + spec.seed)
    dt = getattr(torch, spec.dtype)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device).to(dt)

    q, k, v = randn(spec.batch, spec.hq, spec.d), randn(cap, spec.hkv, spec.d), \
        randn(cap, spec.hkv, spec.d)
    if spec.poison:
        k[int(cu[-1]):] = float("nan")
        v[int(cu[-1]):] = float("nan")
    return DecodeInputs(q, k, v, torch.arange(spec.batch + 1, dtype=torch.int32, device=device),
                        torch.from_numpy(cu).to(device), spec.max_len, spec.d ** -0.5,
                        lens.tolist())


def torch_reference(q, k, v, cq, ck, scale=None):
    """FP32 reference of packed varlen decode on q's device (``qsa-contract.md`` §2).

    Args:
      q: [B, Hq, D]; k, v: [C, Hkv, D]; cq, ck: int32 [B + 1] (same device); scale: softmax scale
        (None: D ** -0.5).
    Returns:
      float32 [B, Hq, D]; zeros for empty rows. Rows are padded to the longest row and masked
      (whatever the padding positions hold, NaN included, never reaches the output); the gathered
      FP32 K/V is bounded to 512 MiB per chunk of rows.
    """
    import torch  # noqa: PLC0415

    b, hq, d = q.shape
    hkv = k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    lens = (ck[1:] - ck[:-1]).long()
    lmax = max(int(lens.max()), 1)
    pos = torch.arange(lmax, device=q.device)
    valid = pos[None, :] < lens[:, None]
    rows = (ck[:-1].long()[:, None] + pos[None, :]).clamp(0, max(k.shape[0] - 1, 0))
    out = torch.empty(b, hq, d, dtype=torch.float32, device=q.device)
    step = max(1, (1 << 27) // (lmax * hkv * d))
    for s0 in range(0, b, step):
        sl = slice(s0, min(b, s0 + step))
        pad = ~valid[sl][:, :, None, None]
        kk = k[rows[sl]].float().masked_fill(pad, 0.0)  # [b', L, Hkv, D]
        vv = v[rows[sl]].float().masked_fill(pad, 0.0)
        qq = q[cq[:-1].long()[sl]].float().view(-1, hkv, hq // hkv, d)
        sc = torch.einsum("bhgd,blhd->bhgl", qq, kk) * scale
        p = torch.softmax(sc.masked_fill(~valid[sl][:, None, None, :], float("-inf")), -1)
        out[sl] = torch.einsum("bhgl,blhd->bhgd", p.nan_to_num(0.0), vv).reshape(-1, hq, d)
    return out


# ------------------------------------------------------------------------------ providers
def _ours(inp: DecodeInputs):
    import qsa_triton  # noqa: PLC0415

    return lambda: qsa_triton.sparse_decode(*inp.args)


def _peer():
    from interop.validate import peer  # noqa: PLC0415

    return peer


def _sm121(inp: DecodeInputs):
    sm121 = _peer().load_sm121_decode()
    return lambda: sm121.qwen38_qsa_sm121(inp.q, inp.k, inp.v, inp.cu_q, inp.cu_k, inp.scale)


def _generic(inp: DecodeInputs):
    import torch  # noqa: PLC0415

    up = _peer().load_sparse_attn()
    kv_lens = (inp.cu_k[1:] - inp.cu_k[:-1]).contiguous()
    # identity positions per row, -1 after the row's length: upstream masks only idx < 0
    pos = torch.arange(max(max(inp.lens), 1), dtype=torch.int32, device=inp.q.device)
    idx = torch.where(pos[None, :] < kv_lens[:, None], pos[None, :], -1).to(torch.int32)
    return lambda: up.sparse_gqa_packed_decode_triton(inp.q, inp.k, inp.v, idx, inp.cu_q,
                                                      inp.cu_k, kv_lens, inp.scale)


def _pallas(inp: DecodeInputs):
    import qsa_pallas  # noqa: PLC0415

    return common.jax_chain(qsa_pallas.sparse_decode, inp.args, {}, CHAIN)


def _sm121_supports(desc: dict) -> str | None:
    if (desc["Hq"], desc["Hkv"]) not in ((24, 2), (12, 1)) or desc["B"] > 128:
        return "upstream's SM121 kernel takes (24,2) and (12,1) heads, B <= 128"
    return None


PROVIDERS = {p.name: p for p in (
    common.Provider("ours", _ours, "qsa_triton.sparse_decode"),
    common.Provider("upstream-sm121", _sm121, "upstream's packed decode kernel "
                    "(kda_kernels/qwen38_qsa_sm121, peer loaded from the 0.5.23 wheel)",
                    supports=_sm121_supports),
    common.Provider("upstream-generic", _generic, "upstream's sparse_gqa_packed_decode_triton "
                    "(its chunk-prefill kernel with one query row per sequence)"),
    common.Provider("pallas", _pallas, "qsa_pallas.sparse_decode (JAX; chain of 20 in one jit)",
                    default=False),
)}


# ----------------------------------------------------------------------------------- cases
def cases(args, kind: str) -> list[C.DecodeSpec]:
    """The specs of one run: ``bench`` (the grid, filtered by ``--tp/--batches/--rows``),
    ``smoke`` (tiny fp16 shapes for the CPU interpreters) or ``memcheck`` (empty rows, K/V sized
    exactly to the rows or followed by NaN rows, every merge path: B = 1 .. 128)."""
    tps = common.choose(getattr(args, "tp", None), C.TP_SHAPES, "--tp")
    rows = common.choose(getattr(args, "rows", None), C.BENCH_DECODE_ROWS, "--rows")
    batches = common.positive_ints(getattr(args, "batches", None), C.BENCH_DECODE_BATCHES,
                                   "--batches")
    spec = C.DecodeSpec
    if kind == "smoke":
        return [spec("decode/TP4/B2/mixed/D64", 6, 1, 64, 2, "mixed", max_len=67,
                     dtype="float16", pad_capacity=False, seed=1),
                spec("decode/TP1/B3/short+empty/D64", 24, 2, 64, 3, "short", max_len=200,
                     dtype="float16", zero_rows=1, slack=5, poison=True, pad_capacity=False,
                     seed=2)]
    if kind == "memcheck":
        return [spec(f"decode/{tp}/B{b}/{r}{'+nan' if slack else ''}", *C.TP_SHAPES[tp], D, b, r,
                     zero_rows=zero, slack=slack, poison=bool(slack), pad_capacity=False, seed=b)
                for tp, b, r, zero, slack in (
                    ("TP1", 1, "saturated", 0, 0), ("TP2", 1, "short", 0, 4096),
                    ("TP1", 5, "mixed", 1, 0), ("TP4", 5, "mixed", 2, 4096),
                    ("TP2", 16, "saturated", 0, 4096), ("TP1", 64, "mixed", 3, 0),
                    ("TP1", 128, "saturated", 0, 4096), ("TP2", 128, "mixed", 5, 0))]
    return [spec(f"decode/{tp}/B{b}/{r}", *C.TP_SHAPES[tp], D, b, r, pad_capacity=False, seed=b)
            for tp in tps for b in batches for r in rows]


def prepare(spec: C.DecodeSpec, device):
    inp = make_inputs(spec, device)
    return inp, torch_reference(inp.q, inp.k, inp.v, inp.cu_q, inp.cu_k, inp.scale)


def describe(spec: C.DecodeSpec, inp: DecodeInputs) -> dict:
    tp = next((t for t, hh in C.TP_SHAPES.items() if hh == (spec.hq, spec.hkv)), "")
    keys = int(sum(inp.lens))
    return {"name": spec.name, "tp": tp, "Hq": spec.hq, "Hkv": spec.hkv, "D": spec.d,
            "B": spec.batch, "rows": spec.pattern, "keys": keys,
            "bytes": keys * spec.hkv * spec.d * inp.k.element_size() * 2,
            "plot": [[f"{tp} ({spec.hq}/{spec.hkv} heads), {spec.pattern} rows", spec.batch]]}


PACKED = common.Mode("decode", "QSA packed sparse decode", PROVIDERS, cases, prepare, describe,
                     calls=CHAIN)
MODES = {"packed": PACKED}


def add_arguments(ap) -> None:
    ap.add_argument("--tp", metavar="TP1,..", help=f"rank shapes (default {','.join(C.TP_SHAPES)})")
    ap.add_argument("--batches", metavar="B,..", help="batch sizes (default "
                    + ",".join(map(str, C.BENCH_DECODE_BATCHES)) + ")")
    ap.add_argument("--rows", metavar="KIND,..", help="row lengths: saturated (2051 keys), mixed "
                    "(17..2051), short (1..64) (default " + ",".join(C.BENCH_DECODE_ROWS) + ")")


def main(argv=None, prog: str | None = None) -> int:
    """``python3 -m bench.decode`` / ``qsa bench decode``; see the module docstring."""
    return common.main(MODES, "bench.decode", argv, prog, __doc__, add_arguments)


if __name__ == "__main__":  # run as bench.decode, so that pickled inputs name that module
    from bench.decode import main as _main

    sys.exit(_main())
