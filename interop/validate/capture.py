"""Capture one kernel call to a file and replay it (``qsa capture``, ``qsa replay``).

File format ``qsa-capture/1``: one safetensors file per call.

Tensors, named as the entry point's parameters (``qsa-contract.md``, ``interop.cases.PARAMS``),
stored contiguous on the CPU in their own dtype (bf16/fp16/fp32/int32); FP8 (float8_e4m3fn) as
its raw bytes (uint8, same shape), named in ``fp8_tensors``, so numpy-only readers load every
file; ``expected_out`` (optional): the output the capturing implementation returned.
  * ``sparse_decode``: q, k, v, cu_seqlens_q, cu_seqlens_k
  * ``sparse_prefill``: q, k, v, indices, cu_seqlens
  * ``sparse_prefill_chunk``: q, k, v, indices, cu_seqlens_q, cu_seqlens_k, kv_lens
  * ``sparse_prefill_paged``: q, k_cache, v_cache, req_to_token, req_indices, indices,
    cu_seqlens_q, kv_lens (a file with a per-request ``slot_table`` instead replays with
    req_to_token = slot_table, req_indices = 0..B-1)
  * ``sparse_decode_paged``: q, k_cache, v_cache (the whole pool), req_to_token, req_indices,
    indices, seq_lens
  * a prefill call in the block form (``indices=None``): ``block_indices`` instead of
    ``indices`` (the scalars record indices as null)

Metadata (safetensors ``__metadata__``, all strings): ``format`` "qsa-capture/1"; ``entry``;
``op`` "decode" | "prefill" | "paged" (``interop.cases.ENTRY_OP``); ``scalars`` (JSON of the
host arguments: max_seqlen_k or max_seqlen_q, softmax_scale, k_scale, v_scale,
batch_invariant); ``fp8_tensors`` (JSON list); ``arch`` ("sm_90", or "cpu"); ``device``;
``rank_shape`` ("TP1 Hq=24 Hkv=2 D=256"); ``model_revision`` (free text); ``producer`` (who
produced ``expected_out``); ``created`` (UTC ISO time); ``versions`` (JSON); ``note``.

``capture_call(fn, *args, path=..., **kwargs)`` calls an entry point and stores its inputs and
output; ``replay(paths, impls)`` runs every implementation on each file against the FP64
reference and the stored output.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import platform
from pathlib import Path
from typing import Any, Sequence

from interop.cases import ENTRY_OP, KW_DEFAULTS, PARAMS, TP_SHAPES

__all__ = ["FORMAT", "ENTRIES", "Capture", "save_capture", "capture_call", "load_capture",
           "replay", "spec_for"]

FORMAT = "qsa-capture/1"
#: the entry points a capture file can hold: the attention ones
ENTRIES = tuple(e for e, op in ENTRY_OP.items() if op in ("decode", "prefill", "paged"))
_FP8 = ("float8_e4m3fn", "float8_e5m2")


@dataclasses.dataclass
class Capture:
    """A loaded capture: ``tensors`` parameter name -> torch tensor (CPU, original dtype), host
    ``scalars``, ``expected`` stored output or None, raw ``metadata``."""

    entry: str
    tensors: dict
    scalars: dict
    expected: Any
    metadata: dict

    @property
    def op(self) -> str:
        return ENTRY_OP[self.entry]

    def inputs(self, device: str = "cpu"):
        """``interop.validate.crosscheck.Inputs`` for the runner, tensors on ``device``."""
        from .crosscheck import Inputs  # noqa: PLC0415

        pos, kws = PARAMS[self.entry]
        if "slot_table" in self.tensors and "req_to_token" not in self.tensors:
            import torch  # noqa: PLC0415

            st = self.tensors["slot_table"]
            self.tensors.update(req_to_token=st,
                                req_indices=torch.arange(st.shape[0], dtype=torch.int32))
        args = [self.tensors[n].to(device) if n in self.tensors else self.scalars[n] for n in pos]
        kwargs = {k: self.scalars.get(k, KW_DEFAULTS[k]) for k in kws}
        if "block_indices" in self.tensors:
            kwargs["block_indices"] = self.tensors["block_indices"].to(device)
        return Inputs(self.entry, args, kwargs, None, {"capture": self.metadata})


def _tdtype(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def _rank_shape(q, k) -> str:
    hq, hkv, d = int(q.shape[1]), int(k.shape[1]), int(q.shape[2])
    tp = next((n for n, pair in TP_SHAPES.items() if pair == (hq, hkv)), None)
    return f"{tp + ' ' if tp else ''}Hq={hq} Hkv={hkv} D={d}"


def _device_meta(t) -> tuple[str, str]:
    if t.device.type != "cuda":
        return "cpu", f"CPU ({platform.machine()})"
    import torch  # noqa: PLC0415

    from interop.arch import arch_name  # noqa: PLC0415

    props = torch.cuda.get_device_properties(t.device)
    return arch_name((props.major, props.minor)), props.name


def save_capture(path, entry: str, values: dict, *, expected=None, model_revision: str = "",
                 producer: str = "", note: str = "") -> Path:
    """Write one call (inputs by parameter name, optional output) as a ``qsa-capture/1`` file.

    Args:
      path: destination (``.safetensors``); parent folders are created.
      entry: one of ``ENTRIES`` ("sparse_decode", "sparse_decode_paged", the prefill variants).
      values: parameter name -> torch tensor (any device) or host scalar; missing keyword
        parameters take their defaults (``interop.cases.KW_DEFAULTS``: softmax_scale None,
        k_scale = v_scale = 1.0, batch_invariant False); a prefill call's block form:
        ``indices`` None and ``block_indices`` a tensor.
      expected: the output tensor, or None.

    Raises:
      ValueError: unknown entry or a missing positional parameter.
    """
    import torch  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415

    from .crosscheck import versions  # noqa: PLC0415

    if entry not in ENTRIES:
        raise ValueError(f"unknown entry point {entry!r}; known: {', '.join(ENTRIES)}")
    pos, kws = PARAMS[entry]
    missing = [n for n in pos if n not in values]
    if missing:
        raise ValueError(f"{entry}: missing parameter(s) {missing}")
    tensors, scalars, fp8 = {}, {}, []
    blocks = values.get("block_indices") if ENTRY_OP[entry] == "prefill" else None
    for name in pos + kws + (("block_indices",) if blocks is not None else ()):
        v = values.get(name, KW_DEFAULTS.get(name))
        if isinstance(v, torch.Tensor):
            t = v.detach().to("cpu").contiguous()
            if _tdtype(t) in _FP8:
                fp8.append([name, _tdtype(t)])
                t = t.view(torch.uint8)
            tensors[name] = t
        else:
            scalars[name] = v if v is None or isinstance(v, bool) else (
                int(v) if isinstance(v, int) else float(v))
    q, k = values[pos[0]], values[pos[1]]
    if expected is not None:
        tensors["expected_out"] = expected.detach().to("cpu").contiguous()
    arch, device = _device_meta(q)
    meta = {"format": FORMAT, "entry": entry, "op": ENTRY_OP[entry],
            "scalars": json.dumps(scalars), "fp8_tensors": json.dumps(fp8), "arch": arch,
            "device": device, "rank_shape": _rank_shape(q, k), "model_revision": model_revision,
            "producer": producer, "note": note,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "versions": json.dumps(versions())}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return path


def capture_call(fn, *args, path, entry: str | None = None, model_revision: str = "",
                 producer: str | None = None, note: str = "", **kwargs):
    """Call ``fn(*args, **kwargs)`` (an entry point, named ``entry``, default ``fn.__name__``),
    save its inputs and output to ``path`` (``producer`` default ``module.entry``) and return the
    output. Raises ValueError: ``entry`` not one of ``ENTRIES``."""
    entry = entry or getattr(fn, "__name__", "")
    if entry not in ENTRIES:
        raise ValueError(f"cannot tell the entry point of {fn!r}; pass entry= one of {list(ENTRIES)}")
    pos, kws = PARAMS[entry]
    values = dict(zip(pos + kws, args))
    values.update({k: v for k, v in kwargs.items() if k in pos + kws + ("block_indices",)})
    out = fn(*args, **kwargs)
    save_capture(path, entry, values, expected=out, model_revision=model_revision,
                 producer=producer or f"{getattr(fn, '__module__', '?')}.{entry}", note=note)
    return out


def load_capture(path) -> Capture:
    """Read a ``qsa-capture/1`` file (tensors on the CPU, FP8 re-viewed).

    Raises:
      ValueError: not a qsa capture, a newer format, or an entry point outside ``ENTRIES``.
    """
    import torch  # noqa: PLC0415
    from safetensors import safe_open  # noqa: PLC0415

    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = dict(fh.metadata() or {})
            tensors = {k: fh.get_tensor(k) for k in fh.keys()} if meta.get("format") == FORMAT else {}
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - SafetensorError is not a ValueError
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from e
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} file (format={meta.get('format')!r})")
    if meta.get("entry") not in ENTRIES:
        raise ValueError(f"{path}: entry point {meta.get('entry')!r} is not one of {ENTRIES}")
    for name, dtype in json.loads(meta.get("fp8_tensors", "[]")):
        tensors[name] = tensors[name].view(getattr(torch, dtype))
    expected = tensors.pop("expected_out", None)
    return Capture(meta["entry"], tensors, json.loads(meta.get("scalars", "{}")), expected, meta)


def spec_for(cap: Capture, name: str):
    """A ``crosscheck`` spec of a capture's shapes (for ``Implementation.supports``)."""
    from interop.cases import DecodeSpec, PagedSpec, PrefillSpec  # noqa: PLC0415

    from .crosscheck import PREFILL_KIND  # noqa: PLC0415

    t = cap.tensors
    q = t["q"]
    k = t.get("k", t.get("k_cache"))
    hq, hkv, d = int(q.shape[1]), int(k.shape[1]), int(q.shape[2])
    kv_dtype = None if _tdtype(k) == _tdtype(q) else _tdtype(k)
    if cap.entry == "sparse_decode":
        return DecodeSpec(name, hq, hkv, d, int(q.shape[0]), "mixed",
                          max_len=int(cap.scalars.get("max_seqlen_k", 1)), dtype=_tdtype(q))
    if cap.entry == "sparse_decode_paged":  # one "request" per row: the rows' own lengths
        return PagedSpec(name, hq, hkv, d, tuple(int(x) for x in t["seq_lens"].tolist()),
                         width=int(t["indices"].shape[-1]), dtype=_tdtype(q), kv_dtype=kv_dtype,
                         k_scale=float(cap.scalars.get("k_scale", 1.0)),
                         v_scale=float(cap.scalars.get("v_scale", 1.0)),
                         per_head=t["indices"].ndim == 3, pool_slots=int(k.shape[0]),
                         batch_invariant=bool(cap.scalars.get("batch_invariant", False)))
    cu = t.get("cu_seqlens", t.get("cu_seqlens_q"))
    kv = t.get("kv_lens")
    ids = t["indices"] if "indices" in t else t["block_indices"]
    return PrefillSpec(name, PREFILL_KIND[cap.entry], hq, hkv, d,
                       tuple(int(x) for x in (cu[1:] - cu[:-1]).tolist()),
                       None if kv is None else tuple(int(x) for x in kv.tolist()),
                       width=int(ids.shape[-1]), dtype=_tdtype(q), kv_dtype=kv_dtype,
                       per_head=ids.ndim == 3, blocks="indices" not in t)


def replay(paths: Sequence, impls, *, device: str = "cpu", reference: str = "auto",
           rel_l2_limit: float | None = None) -> list[tuple[Capture, Any, dict]]:
    """Run every implementation on each capture, judged against the FP64 reference (rel L2 <=
    ``rel_l2_limit``, default ``REL_L2``). Returns per file (capture, ``crosscheck.CaseResult``,
    stored): stored ``{"rel_l2_vs_reference", "within_tolerance"}`` of the stored output, None
    when the file has none."""
    from interop.cases import compare  # noqa: PLC0415

    from . import crosscheck as X  # noqa: PLC0415

    limit = X.REL_L2 if rel_l2_limit is None else rel_l2_limit
    out = []
    for p in paths:
        cap = load_capture(p)
        inp = cap.inputs(device)
        spec = spec_for(cap, str(p))
        ref, method = X._reference(inp, reference, spec.size)
        expected = None if cap.expected is None else X._np64(cap.expected)
        res = X.evaluate(str(p), cap.op, inp, impls, ref, spec=spec, reference=method,
                         expected=expected, rel_l2_limit=limit)
        stored = None
        if expected is not None:  # judged by the same criteria, reported only
            r = compare(expected, ref, None, limit)
            stored = {"rel_l2_vs_reference": r["rel_l2"], "within_tolerance": r["passed"]}
        out.append((cap, res, stored))
    return out
