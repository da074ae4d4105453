"""The conformance base both implementations are tested with (tokamax's ``test_base`` pattern).

``Conformance`` holds the tests; ``tests/test_conformance_triton.py`` and
``tests/test_conformance_pallas.py`` subclass it once each with a small adapter: how to make an
array of a dtype on the device, how to read one back, which function is an entry point, extra
keyword arguments (Pallas: ``interpret``). Every case comes from ``interop.cases``
(``conformance_matrix()`` on any machine, ``gpu_conformance_matrix()`` with ``-m gpu``); every
output is judged against ``interop.reference`` in float64 on the values the kernel actually saw
(fp16 / bf16 / FP8 rounding included) by ``interop.cases.compare``: finite, rtol = atol = 2e-2,
relative L2 <= 5e-3, exact zeros where a row has no valid key.

The contract's refusals are tested here too: a call outside what the kernels compute correctly
raises ``interop.contract.ContractError`` naming the argument, before any launch.

The packed decode's batch-invariant mode (``qsa-contract.md`` §2c) is tested bitwise per
implementation (``test_batch_invariant_bits``: batch compositions, row orders, zero-length
neighbours, ``max_seqlen_k`` bounds; its "gpu" case at production shapes with ``-m gpu``), and
an attended NaN must reach the output exactly where the reference has one, whatever the split
count (``test_attended_nan_propagates``).

This module is not collected itself (no ``test_`` prefix); it imports numpy and the core only.
"""

from __future__ import annotations

import inspect
import os

import numpy as np
import pytest

from interop import cases as C
from interop.contract import QUALIFIED, ContractError
from interop.plan import plan_decode
from interop.reference import decode_reference

ON_GPU = os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")
PUBLIC = ("sparse_decode", "sparse_prefill", "sparse_prefill_chunk", "sparse_prefill_paged")


class Conformance:
    """Tests shared by every implementation. A subclass (named ``Test...``) sets ``name`` and
    implements the adapter methods below."""

    name = "?"
    #: extra keyword arguments for every entry point call (e.g. ``{"interpret": True}``)
    call_kwargs: dict = {}

    # ---- adapter -------------------------------------------------------------------------
    def module(self):
        """The implementation's package (``qsa_triton`` / ``qsa_pallas``)."""
        raise NotImplementedError

    def array(self, x: np.ndarray, dtype: str):
        """A framework array of ``x`` cast to ``dtype`` ("float16", "bfloat16",
        "float8_e4m3fn", "float32", "int32") on the device the tests run on."""
        raise NotImplementedError

    def to_numpy(self, x) -> np.ndarray:
        """A framework array's values as float64 (integers as int64)."""
        raise NotImplementedError

    def dtype_name(self, x) -> str:
        """"float16", "bfloat16", ... of a framework array."""
        raise NotImplementedError

    def requiring_grad(self, x):
        """``x`` marked as needing a gradient, or None where the framework has no such mark."""
        return None

    # ---- helpers -------------------------------------------------------------------------
    def entry(self, name: str):
        fn = getattr(self.module(), name, None)
        if fn is None:
            pytest.fail(f"{self.name} has no entry point {name}")
        return fn

    def arrays(self, data: C.CaseData) -> tuple[dict, dict]:
        """(framework arrays by parameter name, the float32 values they were made from)."""
        values = data.values()
        named = {n: self.array(values[n], dt) for n, (_, dt) in data.floats.items()}
        named.update({n: self.array(a, "int32") for n, a in data.ints.items()})
        return named, values

    def run(self, spec: C.Spec):
        """Build the case's arrays, call the entry point; (output, reference, CaseData)."""
        data = C.case_data(spec)
        named, _ = self.arrays(data)
        args, kwargs = data.arguments(named)
        out = self.entry(data.entry)(*args, **kwargs, **self.call_kwargs)
        seen = {n: self.to_numpy(named[n]) for n in data.floats}  # as the kernel saw them
        ref = C.reference(data.entry, {**data.scalars, **data.ints, **seen})
        return out, ref, data

    def check(self, spec: C.Spec):
        out, ref, data = self.run(spec)
        q_shape, q_dtype = data.floats["q"]
        assert tuple(out.shape) == q_shape, f"output shape {tuple(out.shape)}, expected {q_shape}"
        assert self.dtype_name(out) == q_dtype, f"output dtype {self.dtype_name(out)}, not q's"
        got = self.to_numpy(out)
        v = C.compare(got, ref, data.empty)
        why = [w for w, ok in (("non-finite output", v["finite"]),
                               (f"max |err| {v['max_abs']:.3g} beyond rtol=atol={C.RTOL:g}",
                                v["allclose"]),
                               (f"rel L2 {v['rel_l2']:.2e} > {C.REL_L2:g}",
                                v["rel_l2"] <= C.REL_L2),
                               ("rows without a valid key not exactly 0", v["zeros_ok"])) if not ok]
        assert v["passed"], f"{self.name} {spec.name}: " + "; ".join(why)
        return data, got

    def decode_args(self, b=2, hq=12, hkv=1, d=64, dtype="float16", kv_dtype=None, lens=(3, 5)):
        """A small valid decode call (positional args) to make invalid by one change."""
        rng = np.random.default_rng(0)
        lens = (list(lens) * b)[:b]
        cu_k = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        cap = int(cu_k[-1]) + 1
        return [self.array(rng.standard_normal((b, hq, d), np.float32), dtype),
                self.array(rng.standard_normal((cap, hkv, d), np.float32), kv_dtype or dtype),
                self.array(rng.standard_normal((cap, hkv, d), np.float32), kv_dtype or dtype),
                self.array(np.arange(b + 1, dtype=np.int32), "int32"),
                self.array(cu_k, "int32"), max(lens)]

    def packed_call(self, pool, order, max_seqlen_k, dtype, *, want_ref=True, **kwargs):
        """``sparse_decode`` on the sequences ``order`` (ids into ``pool``, a [(q [Hq, D],
        k [n, Hkv, D], v [n, Hkv, D])] list of float32 arrays) packed in that order, with two
        NaN-filled K/V rows after the last key (never named, so never read). Returns (the
        output as float64, its raw bits, the reference on the values the kernel saw, or None
        without ``want_ref``)."""
        q = np.stack([pool[i][0] for i in order])
        hkv, d = pool[0][1].shape[1:]
        slack = np.full((2, hkv, d), np.nan, np.float32)
        k = np.concatenate([pool[i][1] for i in order] + [slack])
        v = np.concatenate([pool[i][2] for i in order] + [slack])
        cu_k = np.concatenate([[0], np.cumsum([pool[i][1].shape[0] for i in order])])
        args = [self.array(q, dtype), self.array(k, dtype), self.array(v, dtype),
                self.array(np.arange(len(order) + 1, dtype=np.int32), "int32"),
                self.array(cu_k.astype(np.int32), "int32")]
        out = self.to_numpy(self.entry("sparse_decode")(*args, max_seqlen_k, **kwargs,
                                                        **self.call_kwargs))
        ref = decode_reference(*[self.to_numpy(a) for a in args]) if want_ref else None
        return out, out.view(np.int64), ref

    def refused(self, fn, *args, arg: str, **kwargs) -> ContractError:
        with pytest.raises(ContractError) as info:
            fn(*args, **kwargs, **self.call_kwargs)
        e = info.value
        assert e.arg == arg, f"refused naming {e.arg!r}, expected {arg!r}: {e}"
        assert "expected" in str(e) and "got" in str(e) and "Qualified envelope" in str(e)
        return e

    # ---- the cases -----------------------------------------------------------------------
    @pytest.mark.parametrize("spec", C.conformance_matrix(), ids=lambda s: s.name)
    def test_case(self, spec):
        self.check(spec)

    @pytest.mark.gpu
    @pytest.mark.parametrize("spec", C.gpu_conformance_matrix(), ids=lambda s: s.name)
    def test_case_gpu(self, spec):
        """Production shapes on compiled kernels; a second call gives the same bits."""
        if not ON_GPU:
            pytest.skip("needs a CUDA GPU")
        _, got = self.check(spec)
        again = self.to_numpy(self.run(spec)[0])
        assert np.array_equal(got, again), f"{self.name} {spec.name}: second call differs"

    # ---- batch-invariant mode (qsa-contract.md §2c) ---------------------------------------
    @pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
    def test_batch_invariant_bits(self, device):
        """``batch_invariant=True``: every row's output bits are the same in the full batch, in a
        reversed batch, in smaller batches with other neighbours (zero-length ones among them),
        alone, and under other valid ``max_seqlen_k`` bounds (so other split grids); values
        match the FP64 reference. "cpu": fp16, D = 64, (12, 1), rows up to 600 keys (3 splits
        of 256 keys). "gpu" (-m gpu, the H200): bf16, D = 256, (24, 2) and (12, 1), 128 rows of
        0..2051 keys, a row alone at B = 1 (where the default plan uses 33-65 splits), up to
        max_seqlen_k = 4096."""
        if device == "gpu" and not ON_GPU:
            pytest.skip("needs a CUDA GPU")
        rng = np.random.default_rng(7)
        if device == "cpu":
            pairs, d, dtype = ((12, 1),), 64, "float16"
            lens = [600, 0, 300, 17, 513, 256, 64, 1]
            orders = [(list(range(8))[::-1], 600), ([4, 1, 0], 2055), ([2], 300), ([2], 4096),
                      ([3, 1, 1, 2, 6], 513), ([7, 5, 1], 256)]
            base_msk = 600
        else:
            pairs, d, dtype = ((24, 2), (12, 1)), 256, "bfloat16"
            lens = [int(x) for x in rng.integers(0, 2052, 128)]
            lens[::17] = [0] * len(lens[::17])
            lens[5], lens[77] = 2051, 2051
            perm = [int(x) for x in rng.permutation(128)]
            orders = [([77], 2051), ([77], 2055), ([5, 0, 77], 4096), (perm, 4096),
                      (perm[:37], 2051), (sorted(perm[40:56]), 2055)]
            base_msk = 2051
        for hq, hkv in pairs:
            pool = [(rng.standard_normal((hq, d), np.float32),
                     rng.standard_normal((n, hkv, d), np.float32),
                     rng.standard_normal((n, hkv, d), np.float32)) for n in lens]
            base, base_bits, ref = self.packed_call(pool, range(len(lens)), base_msk, dtype,
                                                    batch_invariant=True)
            v = C.compare(base, ref, np.array([n == 0 for n in lens]))
            assert v["passed"], f"{self.name} ({hq}, {hkv}): {v}"
            splits = plan_decode(1, hkv, hq // hkv, d, base_msk, batch_invariant=True).max_splits
            assert splits >= 3, splits  # the merge runs, with splits left empty by short rows
            for order, msk in orders:
                _, bits, _ = self.packed_call(pool, order, msk, dtype, want_ref=False,
                                              batch_invariant=True)
                for i, r in enumerate(order):
                    assert np.array_equal(bits[i], base_bits[r]), \
                        f"{self.name} ({hq}, {hkv}): row {r} at {i} of {len(order)}, msk {msk}"

    @pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreters' NaN arithmetic
    @pytest.mark.parametrize("batch_invariant", [False, True])
    def test_attended_nan_propagates(self, batch_invariant):
        """A NaN in a key, value or query a row attends gives that row NaN for its KV head's query
        heads (K: every column of the group; V: that column; q: that head), as the FP64
        reference does, whatever the row's split count: rows 0 and 5 (300 keys) split in both
        modes, row 1 (40 keys) does not, row 3 (70 keys) splits in the default plan only. Row 5:
        its last 44 keys score 256 below the others, so in the default plan their split's merge
        weight underflows to 0 in FP32 (not in the reference's FP64), with a NaN value among
        them. A NaN query head gives every split of its row a NaN LSE. NaN K/V rows that no row
        names (after the last key) never reach the output; everything else matches the
        reference."""
        rng = np.random.default_rng(11)
        hq, hkv, d = 24, 2, 64
        lens = [300, 40, 0, 70, 9, 300]
        pool = [(rng.standard_normal((hq, d), np.float32),
                 rng.standard_normal((n, hkv, d), np.float32),
                 rng.standard_normal((n, hkv, d), np.float32)) for n in lens]
        pool[0][1][201, 0, 5] = np.nan  # K, long row, KV head 0
        pool[0][0][20, 3] = np.nan  # q, long row, head 20 (KV head 1)
        pool[1][1][3, 1, :] = np.nan  # K, one-split row, KV head 1
        pool[3][2][60, 0, 7] = np.nan  # V, KV head 0, column 7 only
        q5, k5, v5 = pool[5]
        q5[:] = 4.0  # scores (scale 1/8) +128 for keys < 256, -128 after
        k5[:256], k5[256:] = 4.0, -4.0
        v5[280, 1, 9] = np.nan  # V of a key with weight exp(-256), KV head 1, column 9
        out, _, ref = self.packed_call(pool, range(len(lens)), 300, "float16",
                                       batch_invariant=batch_invariant)
        nan_ref = np.isnan(ref)
        assert nan_ref[0, :12].all() and nan_ref[0, 20].all() and nan_ref[1, 12:].all()
        assert nan_ref[3, :12, 7].all() and nan_ref[5, 12:, 9].all()
        assert nan_ref.sum() == 2 * 12 * d + d + 12 + 12
        assert np.array_equal(np.isnan(out), nan_ref), \
            f"{self.name}: NaN at {np.argwhere(np.isnan(out) != nan_ref)[:4].tolist()} differ"
        fin = ~nan_ref
        err = np.abs(out[fin] - ref[fin])
        assert (err <= C.ATOL + C.RTOL * np.abs(ref[fin])).all(), err.max()
        assert (out[2] == 0).all()
        # the splits each row gets (the device rule of interop/plan.py) under the plan of this
        # mode: Triton's default (balance, one-block splits), Pallas's default, batch-invariant
        plans = ([plan_decode(5, hkv, hq // hkv, d, 300, batch_invariant=True)] if batch_invariant
                 else [plan_decode(5, hkv, hq // hkv, d, 300, balance=True, one_block_splits=True),
                       plan_decode(5, hkv, hq // hkv, d, 300)])
        for p in plans:
            n_active = []
            for n in lens:
                k = min(max(-(-(-(-n // p.block_n)) // p.min_blocks_per_split), 1), p.max_splits)
                if p.balance_slots:
                    k = min(k, max(n * p.balance_slots // (sum(lens) * hkv), 1))
                n_active.append(k)
            assert n_active == ([2, 1, 1, 1, 1, 2] if batch_invariant else [5, 1, 1, 2, 1, 5]), \
                (p, n_active)

    # ---- one interface -------------------------------------------------------------------
    def test_same_entry_points_same_parameters(self):
        """The contract's names, with the contract's positional parameters in its order."""
        mod = self.module()
        assert mod.ContractError is ContractError
        for name in PUBLIC:
            fn = self.entry(name)
            params = list(inspect.signature(fn).parameters.values())
            pos, kws = C.PARAMS[name]
            got = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY,
                                                         p.POSITIONAL_OR_KEYWORD)]
            assert tuple(got[:len(pos) + len(kws)]) == pos + kws, (name, got)
            assert "strict" in {p.name for p in params if p.kind == p.KEYWORD_ONLY}, name

    # ---- refusals ------------------------------------------------------------------------
    def test_wrong_dtype_is_refused(self):
        fn = self.entry("sparse_decode")
        self.refused(fn, *self.decode_args(dtype="float32"), arg="q")
        q, k, v, *rest = self.decode_args()
        k32 = self.array(self.to_numpy(k).astype(np.float32), "float32")
        self.refused(fn, q, k32, v, *rest, arg="k")

    def test_wrong_head_pair_is_refused_in_strict_mode(self):
        fn = self.entry("sparse_decode")
        args = self.decode_args(hq=16, hkv=2, d=256)  # group 8: computable, not qualified
        e = self.refused(fn, *args, arg="q", strict=True)
        assert "strict mode" in str(e) and "(16, 2)" in str(e)

    def test_batch_129_is_refused_in_strict_mode(self):
        fn = self.entry("sparse_decode")
        hi = QUALIFIED["batch"][1]
        args = self.decode_args(b=hi + 1, hq=12, hkv=1, d=256, lens=(1,))
        e = self.refused(fn, *args, arg="q", strict=True)
        assert f"B = {hi + 1}" in str(e)

    def test_decode_max_seqlen_q_other_than_1_is_refused(self):
        """Decode has one query row per sequence: the flash-attn style entry point refuses
        max_seqlen_q = 2 instead of silently computing one row."""
        fa = getattr(self.module(), "flash_attn_varlen_func", None)
        if fa is None:
            pytest.skip(f"{self.name} has no flash_attn_varlen_func")
        q, k, v, cq, ck, msk = self.decode_args()
        self.refused(fa, q, k, v, cq, ck, max_seqlen_q=2, max_seqlen_k=msk, arg="max_seqlen_q")

    def test_requires_grad_input_is_refused(self):
        """The library is forward-only: an input that asks for a gradient is refused up front,
        not left to fail in ``backward()``."""
        q, *rest = self.decode_args()
        qg = self.requiring_grad(q)
        if qg is None:
            pytest.skip(f"{self.name}: arrays carry no requires_grad mark")
        self.refused(self.entry("sparse_decode"), qg, *rest, arg="q")

    def test_requires_grad_input_runs_without_grad_mode(self):
        """Under torch.no_grad() / inference_mode() nothing records a graph: an input marked
        requires_grad runs and gives the result of its detached copy, bit for bit."""
        q, *rest = self.decode_args()
        qg = self.requiring_grad(q)
        if qg is None:
            pytest.skip(f"{self.name}: arrays carry no requires_grad mark")
        import torch  # noqa: PLC0415  (only frameworks with the mark get here)

        fn = self.entry("sparse_decode")
        want = self.to_numpy(fn(q, *rest))
        for mode in (torch.no_grad, torch.inference_mode):
            with mode():
                np.testing.assert_array_equal(self.to_numpy(fn(qg, *rest)), want)

    def test_prefill_refusals(self):
        """Per-head indices with the wrong head count, FP8 K/V where the variant takes q's
        dtype, K/V scales without FP8, indices that are not int32."""
        spec = C.PrefillSpec("refusal", "chunk", 12, 2, 64, (3,), (9,), width=8,
                             dtype="float16", per_head=True)
        data = C.case_data(spec)
        named, values = self.arrays(data)
        chunk = self.entry("sparse_prefill_chunk")
        args, kwargs = data.arguments(named)
        bad = {**named, "indices": self.array(data.ints["indices"][:, :1], "int32")}
        self.refused(chunk, *data.arguments(bad)[0], arg="indices", **kwargs)
        bad = {**named, "indices": self.array(data.ints["indices"].astype(np.float32), "float32")}
        self.refused(chunk, *data.arguments(bad)[0], arg="indices", **kwargs)
        self.refused(chunk, *args, arg="k_scale", **{**kwargs, "k_scale": 0.5})
        t = data.floats["q"][0][0]
        ordinary = self.entry("sparse_prefill")
        kv = self.array(values["k"][:t], "float8_e4m3fn")
        cu = self.array(np.array([0, t], np.int32), "int32")
        self.refused(ordinary, named["q"], kv, kv, named["indices"], cu, t, arg="k")

    def test_prefill_wrong_head_pair_is_refused_in_strict_mode(self):
        """(Hq, Hkv) = (24, 4) is computable (group 6) but outside the qualified prefill pairs."""
        for kind in C.PREFILL_KINDS:
            spec = C.PrefillSpec(f"strict/{kind}", kind, 24, 4, 256, (2,),
                                 None if kind == "ordinary" else (5,), width=4, dtype="float16")
            data = C.case_data(spec)
            named, _ = self.arrays(data)
            args, kwargs = data.arguments(named)
            e = self.refused(self.entry(data.entry), *args, arg="q", strict=True, **kwargs)
            assert "(24, 4)" in str(e), e
