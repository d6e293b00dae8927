"""The wgmma prefill's cleaning plan (cuda_src/prefill_ws_plan.cuh), compiled for the host by nvcc.

In paged_prefill_wgmma_ws the copiers send a V tile to the v_land mbarrier exactly when the item's
``ws_clean_tiles`` range says so, and the scheduler waits there for exactly the tiles whose keys
``ws_clean_keys`` finds, with parities chained by ``ws_land_after``: a disagreement would hang the
kernel or let it read a tile before it lands. These checks hold the three functions to a brute-force
model: the keys to clean of a tile are its unmasked keys ([kmin, khi)) that lie outside the item's
intersection of admitted ranges (all of them when that is empty); the v_land phases of a stage count
the tiles to clean that went through it. The score masks of a key tile (``ws_mask_rows``, which the
wgmma prefill and the wgmma MLA kernel apply to tiles not inside every row's range) keep exactly the
scores of keys a row admits and the tile maps.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import util

KEYS = 128


@pytest.fixture(scope="module")
def host_plan(tmp_path_factory):
    """tests/data/ws_plan_host.cu compiled for the host: ``run(mode, int32 records) -> int32 array``."""
    run = util.host_program(tmp_path_factory.mktemp("ws_plan"), "ws_plan_host.cu")
    return lambda mode, records: np.frombuffer(run(mode, records.astype("<i4").tobytes()), "<i4")


def _items(rng, n):
    """Random items as the scheduler builds them: a box-aligned origin below kmin, tiles up to khi, and an
    intersection inside [kmin, khi), empty, or (rarely) anywhere."""
    out = []
    for _ in range(n):
        kmin = int(rng.integers(0, 5000))
        khi = kmin + int(rng.integers(1, 1500))
        box = int(rng.choice([1, 8, 16, 32]))
        klo = kmin - kmin % box
        ntiles = -(-(khi - klo) // KEYS)
        kind = rng.random()
        if kind < 0.7:
            x = int(rng.integers(kmin, khi + 1))
            y = int(rng.integers(x, khi + 1))
        elif kind < 0.85:  # empty: no key every live row admits
            x = int(rng.integers(kmin, khi + 1))
            y = x - int(rng.integers(0, 3))
        else:
            x, y = sorted(int(v) for v in rng.integers(0, 7000, 2))
        out.append((klo, kmin, khi, x, y, ntiles))
    return out


def test_clean_tiles_and_keys_match_the_model(host_plan):
    rng = np.random.default_rng(7)
    items = _items(rng, 3000)
    # the causal diagonal of the benchmark's prefill and chunked items (32 tokens of 4 heads), exactly
    for past, t0 in ((0, 0), (0, 96), (0, 2016), (8192, 0), (8192, 480)):
        khi = past + t0 + 32
        items.append((0, 0, khi, 0, past + t0 + 1, -(-khi // KEYS)))
    got = host_plan("tiles", np.array(items, np.int64).reshape(-1))
    pos = 0
    for klo, kmin, khi, x, y, nt in items:
        cx, cy = got[pos], got[pos + 1]
        pos += 2
        assert cy >= cx
        for kt in range(nt):
            flag, count = got[pos], got[pos + 1]
            pos += 2
            k0 = klo + kt * KEYS
            keys = range(max(k0, kmin), min(k0 + KEYS, khi))
            want = sum(1 for k in keys if not x <= k < y) if x < y else len(keys)
            assert count == want, (klo, kmin, khi, x, y, kt)
            assert flag == (want > 0) == (kt < cx or kt >= cy), (klo, kmin, khi, x, y, kt)
    assert pos == got.size


def _chained_items(rng):
    """One CTA's items in order, as (ntiles, clean.x, clean.y): tiles to clean below clean.x and from clean.y."""
    records = []
    for _ in range(int(rng.integers(1, 60))):
        nt = int(rng.integers(0, 40))
        cx = int(rng.integers(0, nt + 2))
        records.append((nt, cx, max(cx, int(rng.integers(0, nt + 3)))))
    return records


def test_land_parities_count_the_tiles_to_clean_of_each_stage(host_plan):
    rng = np.random.default_rng(8)
    for trial in range(20):
        records = _chained_items(rng)
        got = host_plan("land", np.array(records, np.int64).reshape(-1)).reshape(-1, 2)
        first, counts = 0, [0, 0]
        for (nt, cx, cy), (g_first, g_parity) in zip(records, got):
            assert g_first == first
            assert g_parity == (counts[0] & 1) | ((counts[1] & 1) << 1), (trial, records)
            for kt in range(nt):
                if kt < cx or kt >= cy:
                    counts[(first + kt) % 2] += 1
            first += nt


def test_each_tile_to_clean_waits_for_its_own_phase(host_plan):
    """ws_land_at (the copiers' clean of V tiles): a tile to clean waits for the parity of the phases its stage
    has completed before it, counting the tiles to clean of every earlier item and of its own."""
    rng = np.random.default_rng(10)
    for trial in range(20):
        records = _chained_items(rng)
        got = list(host_plan("land_at", np.array(records, np.int64).reshape(-1)))
        want, first, counts = [], 0, [0, 0]
        for nt, cx, cy in records:
            for kt in range(nt):
                if kt < cx or kt >= cy:
                    s = (first + kt) % 2
                    want.append(counts[s] & 1)
                    counts[s] += 1
            first += nt
        assert got == want, (trial, records)


RANGE_NONE_LO, RANGE_NONE_HI = 0x7FFFFFFF, -0x80000000  # prefill_tiles.cuh: the empty-range sentinels


def test_score_masks_keep_exactly_the_admitted_mapped_keys(host_plan):
    """Thread (lane % 4) holds columns 8 j + 2 (lane % 4) + e of its two rows as s[4 j + 2 i + e]; a score
    stays when its key lies in the row's [lo, hi) and its bit of the tile's mapped-key words is set."""
    rng = np.random.default_rng(9)
    records = []
    for _ in range(4000):
        kt0 = int(rng.choice([0, 128, int(rng.integers(0, 1 << 20)), (1 << 31) - 256]))
        rows = []
        for _ in range(2):
            kind = rng.random()
            if kind < 0.1:  # no admitted key: the scheduler's sentinels
                rows += [RANGE_NONE_LO, RANGE_NONE_HI]
            elif kind < 0.2:  # whole tile and beyond
                rows += [kt0 - int(rng.integers(0, 1000)), kt0 + 128 + int(rng.integers(0, 1000))]
            else:  # edges inside the tile or near it (a causal diagonal, a window)
                lo = kt0 + int(rng.integers(-40, 168))
                rows += [lo, lo + int(rng.integers(-5, 200))]
        mw = [int(x) for x in rng.integers(0, 1 << 32, 4, dtype=np.uint64)]
        if rng.random() < 0.5:
            mw = [0xFFFFFFFF] * 4
        mw = [m - (1 << 32) if m >= 1 << 31 else m for m in mw]  # as int32
        rows = [min(v, RANGE_NONE_LO) for v in rows]  # (positions are int32)
        records.append(rows + [kt0] + mw + [int(rng.integers(0, 32))])
    got = host_plan("mask", np.array(records, np.int64).reshape(-1)).reshape(-1, 64)
    for rec, flags in zip(records, got):
        lo0, hi0, lo1, hi1, kt0 = rec[:5]
        mw, lane = [m & 0xFFFFFFFF for m in rec[5:9]], rec[9]
        for k in range(64):
            j, i, e = k // 4, (k % 4) // 2, k % 2
            col = 8 * j + 2 * (lane % 4) + e
            lo, hi = (lo0, hi0) if i == 0 else (lo1, hi1)
            want = lo <= kt0 + col < hi and (mw[col // 32] >> (col % 32)) & 1
            assert flags[k] == int(bool(want)), (rec, k)


def _wg_off(r, c, rows=KEYS):
    """wg_off<rows>(r, c) of cuda_src/wgmma.cuh: where wgmma reads element (r, c) of a 16-bit tile."""
    return (c >> 6) * (rows * 128) + r * 128 + ((((c >> 3) & 7) ^ (r & 7)) << 4) + (c & 7) * 2


def _code_at(r, k):
    """Where TMA's 128-byte swizzle puts 16-byte chunk k of 128-byte row r of a box landing in slab 1 (1024-byte
    aligned): chunk k ^ (r % 8) of the row."""
    return KEYS * 128 + r * 128 + 16 * (k ^ (r % 8))


def test_codes_are_widened_in_place_where_wgmma_reads_them(host_plan):
    """8-bit codes (the copiers' widen_rows): each copier warp reads every code chunk of its 32 rows once, where
    TMA and its own cp.async gathers put them, and writes the channels of each chunk to the two 16-byte chunks
    wgmma reads them from; the slab-1 bytes a step writes are codes that step has read (same rows, one warp),
    so no code is overwritten before it is read."""
    out = host_plan("widen", np.zeros(0, np.int32)).reshape(4, 32, 8, 5)
    read, wide, copied = set(), set(), set()
    for cw in range(4):
        for j in range(8):
            step_read, step_wrote = set(), set()
            for lane in range(32):
                row, ld, lo, hi, dst = (int(x) for x in out[cw, lane, j])
                c8 = lane % 8
                assert row == cw * 32 + 4 * j + lane // 8
                assert ld == _code_at(row, c8) and dst == _code_at(cw * 32 + 4 * j + lane // 8, c8)
                assert (lo, hi) == (_wg_off(row, 16 * c8), _wg_off(row, 16 * c8 + 8))
                step_read.add(ld)
                step_wrote.update((lo, hi))
                copied.add(dst)
            assert not read & step_read and not wide & step_wrote
            read |= step_read
            wide |= step_wrote
            assert {a for a in step_wrote if a >= KEYS * 128} <= step_read
    assert read == copied == set(range(KEYS * 128, 2 * KEYS * 128, 16))
    assert wide == set(range(0, 2 * KEYS * 128, 16))
