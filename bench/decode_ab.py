"""A/B of decode *code* versions in one process (H200): copies of ``qsa_triton/decode.py`` with
one change reverted or forced each, timed interleaved against each other and upstream's SM121
kernel on the same inputs.

Why: decode_variants.py varies plan fields of one kernel; a kernel-code change (a hoisted load,
different split boundaries, a new merge) needs the old and new code side by side, since absolute
times move between runs. Each variant is the current module's source with textual edits
(``EDITS``; an edit that no longer matches fails loudly), written to ``--dir`` and imported
under its own name (its custom op registered as ``qsa_ab_<variant>::sparse_decode``).
``--base FILE`` adds another version of the module (e.g. ``git show REV:qsa_triton/decode.py``)
as variant "base".

Usage (GPU): ``python -m bench.decode_ab [--variants head,head_nopdl,head_pdl,...] [--base FILE]
[--json P]``.
Method as bench/decode.py (CUDA-graph replay, interleaved, median; FP32 reference check).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "qsa_triton" / "decode.py"

#: variant -> (merge mode for the launch, [(old, new) text edits of decode.py]); "<name>_pdl"
#: runs variant <name> with Programmatic Dependent Launch forced on
EDITS = {
    "head": ("auto", []),
    "head_nopdl": ("auto", [("PDL_AUTO = True\n", "PDL_AUTO = False\n")]),
    "merge1024": ("auto", [("MERGE_TILE = 2048\n", "MERGE_TILE = 1024\n")]),
    "merge512": ("auto", [("MERGE_TILE = 2048\n", "MERGE_TILE = 512\n")]),
    # decode v4's PDL policy: no late trigger, so auto PDL only where B x Hkv <= 2; as
    # "no_late_pdl", PDL forced on with the entry trigger everywhere (run 28 measured the late
    # trigger, then an edit of the kernel, against these two)
    "no_late": ("auto", [("PDL_LATE_MIN_KV_ROWS = 64\n", "PDL_LATE_MIN_KV_ROWS = 1 << 62\n")]),
    "inline": ("inline", []),
}
SHAPES = [(tp, b, rows) for tp in ("TP1", "TP2", "TP4") for b in (1, 4, 16)
          for rows in ("saturated", "mixed")] + [
    ("TP1", 32, "saturated"), ("TP1", 32, "mixed"), ("TP2", 64, "saturated"),
    ("TP2", 64, "mixed"), ("TP4", 64, "saturated"), ("TP4", 64, "mixed"),
    ("TP1", 64, "saturated"), ("TP2", 128, "saturated"), ("TP1", 128, "mixed")]


def _load(name: str, text: str, where: Path):
    text = text.replace("from ._interp_guard import", "from qsa_triton._interp_guard import")
    text = text.replace('"qsa::sparse_decode"', f'"qsa_ab_{name}::sparse_decode"')
    path = where / f"decode_ab_{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"decode_ab_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def build_variants(names, where: Path, base: str | None = None) -> dict:
    """name -> (module, merge). Raises ValueError when an edit no longer matches the source."""
    src = SRC.read_text()
    where.mkdir(parents=True, exist_ok=True)
    out = {}
    for n in names:
        if n == "base":
            out[n] = (_load("base", Path(base).read_text(), where), "auto")
            continue
        merge, edits = EDITS[n.removesuffix("_pdl")]
        text = src
        for old, new in edits:
            # anchored at a line start: an indented edit must not match inside a deeper line
            if ("\n" + text).count("\n" + old) != 1:
                raise ValueError(f"decode_ab variant {n}: edit does not match once: {old[:60]!r}")
            text = ("\n" + text).replace("\n" + old, "\n" + new)[1:]
        out[n] = (_load(n, text, where), merge)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(EDITS))
    ap.add_argument("--base", default=None, help="another decode.py to time as variant 'base'")
    ap.add_argument("--dir", default="/tmp/qsa_decode_ab")
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args(argv)
    names = [v for v in args.variants.split(",") if v] + (["base"] if args.base else [])
    bad = [n for n in names if n.removesuffix("_pdl") not in EDITS and n != "base"]
    if bad:
        print(f"--variants: unknown {bad}; allowed: {', '.join(EDITS)}", file=sys.stderr)
        return 2
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        print("bench.decode_ab needs a CUDA GPU", file=sys.stderr)
        return 2
    from bench.common import gpu_name, out_dir, write_json  # noqa: PLC0415
    from bench.decode import MSK, TP, _check, _peer_providers, _timers, make_inputs, torch_reference  # noqa: PLC0415

    mods = build_variants(names, Path(args.dir), args.base)
    dev = torch.device("cuda")
    time_interleaved, _ = _timers(dev)
    res = {"gpu": gpu_name(), "variants": names, "cases": [], "failures": []}
    ratios = {n: [] for n in names}
    for tp, b, rows in SHAPES:
        hq, hkv = TP[tp]
        t0 = time.time()
        q, k, v, cq, ck, lens = make_inputs(tp, b, rows, device=dev)
        ref = torch_reference(q, k, v, cq, ck)
        provs, _ = _peer_providers(q, k, v, cq, ck, lens, 256 ** -0.5, {"generic", "pallas"})
        for n, (mod, merge) in mods.items():
            mod.prepare(dev)
            plan, _ = mod.plan_for(b, hkv, hq // hkv, 256, MSK, dev)
            pdl = True if n.endswith("_pdl") else None
            fn = (lambda mod=mod, plan=plan, merge=merge, pdl=pdl: mod.decode_with_plan(
                q, k, v, cq, ck, MSK, plan=plan, merge=merge, pdl=pdl))
            try:
                chk = _check(fn(), ref)
            except Exception as e:  # noqa: BLE001
                chk = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            if chk.get("ok"):
                provs[n] = fn
            else:
                res["failures"].append({"tp": tp, "B": b, "rows": rows, "variant": n, **chk})
        timing = time_interleaved(provs, rounds=args.rounds, target_replay_us=1000.0)
        base = timing.get("sm121", {}).get("median_us")
        us = {n: round(t["median_us"], 2) for n, t in timing.items() if t.get("median_us")}
        for n in names:
            if base and n in us:
                ratios[n].append(base / us[n])
        res["cases"].append({"tp": tp, "B": b, "rows": rows, "us": us})
        print(f"{tp} B={b:<3d} {rows:9s} " + " | ".join(f"{n} {t:.2f}" for n, t in us.items())
              + f"  [{time.time() - t0:.0f}s]", flush=True)
    res["geomean_vs_sm121"] = {n: math.exp(sum(map(math.log, r)) / len(r)) for n, r in ratios.items() if r}
    for n, g in res["geomean_vs_sm121"].items():
        print(f"[ab] {n:12s} geomean {g:.3f}x vs sm121 over {len(ratios[n])} cases")
    path = write_json(args.json or out_dir() / "decode_ab.json", res)
    print(f"wrote {path}; failures: {res['failures'] or 'none'}")
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
