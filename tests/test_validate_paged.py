"""``interop.contract.validate_decode_paged_metadata``: the host debug validator of paged-decode
metadata (``sparse_decode_paged`` / ``qsa_decode_step``), numpy only (no kernel runs).

The kernels skip what breaks the paged addressing (``qsa-contract.md`` §7), so a caller bug there
(``seq_lens`` past ``req_to_token``'s width, a table row or pool slot out of range) shows only as
fewer keys attended; the validator names it. On well-formed SGLang-style metadata (MTP verify rows
sharing a request, junk index entries, empty rows) it accepts and counts exactly the entries
``interop.indices.resolve_paged_slots`` resolves.
"""

from __future__ import annotations

import numpy as np
import pytest

from interop.contract import ContractError, validate_decode_paged_metadata
from interop.indices import resolve_paged_slots

SLOTS = 500


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    max_reqs, max_ctx = 6, 120
    rtt = rng.integers(1, SLOTS, (max_reqs, max_ctx)).astype(np.int32)
    req_indices = np.array([3, 3, 0, 5, 2], np.int32)        # rows 0, 1: MTP verify of request 3
    seq_lens = np.array([99, 100, 120, 0, 7], np.int32)      # row 3 empty
    indices = rng.integers(-3, 125, (5, 2, 40)).astype(np.int32)  # junk on both sides
    return rtt, req_indices, indices, seq_lens


def test_well_formed_batch_passes_and_counts_the_resolved_entries():
    rtt, ri, idx, sl = _batch()
    got = validate_decode_paged_metadata(rtt, ri, idx, sl, SLOTS)
    assert got == {"rows": 5, "valid": int((resolve_paged_slots(rtt, ri, idx, sl, SLOTS) >= 0).sum())}
    assert got["valid"] > 0
    # 2-D indices, and a bad table row on an empty row (it reads nothing) is fine
    ri2 = ri.copy()
    ri2[3] = 99
    validate_decode_paged_metadata(rtt, ri2, idx[:, 0], sl, SLOTS)


@pytest.mark.parametrize("case, arg, needle", [
    ("seq_lens past the table width", "seq_lens", "max_context = 120"),
    ("req_indices out of range", "req_indices", "[0, 6)"),
    ("negative slot", "req_to_token", "slot -5"),
    ("slot past the pool", "req_to_token", f"slot {SLOTS}"),
])
def test_lying_metadata_is_named(case, arg, needle):
    rtt, ri, idx, sl = _batch(1)
    idx = idx.copy()
    if case == "seq_lens past the table width":
        sl = sl.copy()
        sl[2] = 121
    elif case == "req_indices out of range":
        ri = ri.copy()
        ri[4] = 6
    else:
        idx[1, 0, 0] = 50  # a valid position of row 1 (request 3, seq_len 100)
        rtt = rtt.copy()
        rtt[3, 50] = -5 if case == "negative slot" else SLOTS
    # silent otherwise: the kernels' (and the reference's) rule just drops such entries
    live = (idx >= 0) & (idx < sl[:, None, None]) & (sl > 0)[:, None, None]
    assert (resolve_paged_slots(rtt, ri, idx, sl, SLOTS) >= 0).sum() < live.sum()
    with pytest.raises(ContractError) as e:
        validate_decode_paged_metadata(rtt, ri, idx, sl, SLOTS)
    assert e.value.arg == arg and needle in str(e.value)
    assert "sparse_decode_paged" in str(e.value)


def test_torch_tensors_accepted():
    torch = pytest.importorskip("torch")
    rtt, ri, idx, sl = (torch.from_numpy(a) for a in _batch(2))
    assert validate_decode_paged_metadata(rtt, ri, idx, sl, SLOTS, fn="qsa_decode_step")["rows"] == 5
    with pytest.raises(ContractError, match="qsa_decode_step.*'seq_lens'"):
        validate_decode_paged_metadata(rtt, ri, idx, sl + 1000, SLOTS, fn="qsa_decode_step")


def test_step_metadata_without_indices_checks_every_visible_position():
    """``indices=None`` (``qsa_decode_step``: the indexer may select any position): every
    position < seq_lens[r] of every live row is resolved and counted; a bad slot at a position
    no index names is still caught."""
    rtt, ri, _, sl = _batch(3)
    got = validate_decode_paged_metadata(rtt, ri, None, sl, SLOTS, fn="qsa_decode_step")
    assert got == {"rows": 5, "valid": int(sl.sum())}
    rtt = rtt.copy()
    rtt[0, 119] = SLOTS  # row 2 (request 0, seq_len 120) at its last position
    with pytest.raises(ContractError, match=f"qsa_decode_step.*slot {SLOTS}"):
        validate_decode_paged_metadata(rtt, ri, None, sl, SLOTS, fn="qsa_decode_step")
    # a garbage length is named, not expanded into a 2**31-position range first
    sl = sl.copy()
    sl[1] = 2**31 - 1
    with pytest.raises(ContractError, match=r"'seq_lens'.*row 1: 2147483647"):
        validate_decode_paged_metadata(rtt, ri, None, sl, SLOTS, fn="qsa_decode_step")


@pytest.mark.parametrize("indices", [np.zeros((0, 7), np.int32), np.zeros((0, 2, 7), np.int32),
                                     None])
def test_zero_rows_pass(indices):
    """R = 0 (an idle batch) is a valid call: nothing to check (a reshape used to fail)."""
    rtt = np.zeros((2, 16), np.int32)
    got = validate_decode_paged_metadata(rtt, np.zeros(0, np.int32), indices,
                                         np.zeros(0, np.int32), SLOTS)
    assert got == {"rows": 0, "valid": 0}
