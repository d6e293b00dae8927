"""A host-side model of the wgmma prefill's shared-memory operands and register fragments (no GPU).

It restates prefill_wgmma.cu's placement (wg_off), descriptors (wg_desc_sw128, qk_step, the V
descriptor and its per-step offsets) and the S -> P repack, and checks them against models of the
hardware taken from CUTLASS (include/cute/atom/mma_traits_sm90_gmma.hpp):

- operand fetch: the canonical SW128 layouts of make_gmma_desc, K-major ((8,m),2):((8T,SBO),(1,T))
  and MN-major ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)) (T = 8 16-bit elements = 16 bytes), with the
  128B swizzle applied to the byte address (bits 4..6 ^= bits 7..9, Swizzle<3,4,3>);
- fragments: CLayout_64xN for the f32 accumulator and ALayout_64x16 for A from registers.

It cannot catch a misreading of the hardware shared by the kernel and this model (the first GPU
run does that); it catches slips in the kernel's offsets, strides and index arithmetic. Keep the
constants and formulas in step with prefill_wgmma.cu.
"""

import numpy as np

ROWS, KEYS, D = 128, 64, 128  # WgmmaPrefillConfig
Q_BYTES, TILE_BYTES = ROWS * D * 2, KEYS * D * 2
STAGE_BYTES = 2 * TILE_BYTES


def wg_off(rows, r, c):  # prefill_wgmma.cu wg_off<ROWS_>(r, c), vectorized
    return (c >> 6) * (rows * 128) + r * 128 + ((((c >> 3) & 7) ^ (r & 7)) << 4) + (c & 7) * 2


def wg_desc_sw128(saddr, lbo, sbo):  # wgmma.cuh
    return ((saddr & 0x3FFFF) >> 4) | (((lbo >> 4) & 0x3FFF) << 16) | (((sbo >> 4) & 0x3FFF) << 32) | (1 << 62)


def qk_step(kk, rows):  # prefill_wgmma.cu, in 16-byte units
    return ((kk >> 2) * rows * 128 + (kk & 3) * 32) >> 4


def _fields(desc):
    start, lbo, sbo = (desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4
    assert desc >> 62 == 1 and (desc >> 49) & 7 == 0  # 128B swizzle, base offset 0
    return start, lbo, sbo


def _swizzle(addr):
    return addr ^ (((addr >> 7) & 7) << 4)


def fetch_k_major(mem, desc, rows):
    """The [rows x 16] operand a K-major SW128 descriptor presents (LBO unused)."""
    start, _, sbo = _fields(desc)
    r, k = np.meshgrid(np.arange(rows), np.arange(16), indexing="ij")
    return mem[_swizzle(start + (r // 8) * sbo + (r % 8) * 128 + (k // 8) * 16 + (k % 8) * 2) // 2]


def fetch_mn_major(mem, desc, n):
    """The [16 x n] operand (K rows) an MN-major SW128 descriptor presents."""
    start, lbo, sbo = _fields(desc)
    k, c = np.meshgrid(np.arange(16), np.arange(n), indexing="ij")
    return mem[_swizzle(start + (c // 64) * lbo + (k // 8) * sbo + (k % 8) * 128 + (c % 64) * 2) // 2]


def test_operands_seen_by_each_wgmma():
    rng = np.random.default_rng(0)
    base = 3 * 1024  # the dynamic region after the 1024-byte round-up (static arrays come first)
    mem = np.full((base + Q_BYTES + 2 * STAGE_BYTES) // 2, np.nan)  # 16-bit elements
    r, c = np.meshgrid(np.arange(ROWS), np.arange(D), indexing="ij")
    q = rng.integers(-8, 8, (ROWS, D)).astype(float)
    mem[(base + wg_off(ROWS, r, c)) // 2] = q
    sq_a, stages_a = base, base + Q_BYTES
    kv_desc0 = wg_desc_sw128(stages_a, 16, 1024)
    v_desc0 = wg_desc_sw128(stages_a + TILE_BYTES, KEYS * 128, 1024)
    r, c = np.meshgrid(np.arange(KEYS), np.arange(D), indexing="ij")
    for stage in range(2):
        k = rng.integers(-8, 8, (KEYS, D)).astype(float)
        v = rng.integers(-8, 8, (KEYS, D)).astype(float)
        mem[(stages_a + stage * STAGE_BYTES + wg_off(KEYS, r, c)) // 2] = k
        mem[(stages_a + stage * STAGE_BYTES + TILE_BYTES + wg_off(KEYS, r, c)) // 2] = v
        k_desc = kv_desc0 + (stage * STAGE_BYTES >> 4)
        v_desc = v_desc0 + (stage * STAGE_BYTES >> 4)
        for wg in range(2):  # S = Q K^T: m64n64k16, both K-major
            q_desc0 = wg_desc_sw128(sq_a + wg * 64 * 128, 16, 1024)
            for kk in range(D // 16):
                a = fetch_k_major(mem, q_desc0 + qk_step(kk, ROWS), 64)
                b = fetch_k_major(mem, k_desc + qk_step(kk, KEYS), KEYS)
                np.testing.assert_array_equal(a, q[64 * wg:64 * wg + 64, 16 * kk:16 * kk + 16])
                np.testing.assert_array_equal(b, k[:, 16 * kk:16 * kk + 16])
        for j2 in range(KEYS // 16):  # O += P V: m64n128k16 (or two m64n64k16), V MN-major
            keys = slice(16 * j2, 16 * j2 + 16)
            np.testing.assert_array_equal(fetch_mn_major(mem, v_desc + (j2 * 16 * 128 >> 4), 128), v[keys])
            np.testing.assert_array_equal(fetch_mn_major(mem, v_desc + (j2 * 16 * 128 >> 4), 64), v[keys, :64])
            np.testing.assert_array_equal(
                fetch_mn_major(mem, v_desc + ((KEYS * 128 + j2 * 16 * 128) >> 4), 64), v[keys, 64:])


def _c_layout(t, v):
    """CLayout_64xN / ALayout_64x16: (thread, value) -> (m, n) (offset m + 64 n)."""
    t0, t1, t2 = t % 4, (t // 4) % 8, t // 32
    v0, v1, v2 = v % 2, (v // 2) % 2, v // 4
    off = 128 * t0 + t1 + 16 * t2 + 64 * v0 + 8 * v1 + 512 * v2
    return off % 64, off // 64


def test_accumulator_and_p_fragments():
    for t in range(128):
        warp, lane = t // 32, t % 32
        for i in range(KEYS // 2):  # s[4j + e] = S[16w + l/4 + 8(e/2)][8j + 2(l%4) + e%2]
            j, e = i // 4, i % 4
            assert _c_layout(t, i) == (16 * warp + lane // 4 + 8 * (e // 2), 8 * j + 2 * (lane % 4) + e % 2)
        for j2 in range(KEYS // 16):  # p[j2][reg] = pack(s[8 j2 + 2 reg], s[8 j2 + 2 reg + 1]), low half first
            for reg in range(4):
                for half in range(2):
                    m, n = _c_layout(t, 8 * j2 + 2 * reg + half)
                    am, ak = _c_layout(t, 2 * reg + half)  # A element of k-step j2
                    assert (m, n) == (am, 16 * j2 + ak)
