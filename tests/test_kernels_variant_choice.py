"""Which kernel variant a backend launches on each GPU it claims, from the device description alone.

The compact prefill tiles and the 2-stage tensor-core decode pipeline exist for GPUs whose shared memory
per CTA (sm_86/89/120: 99 KB) or per SM (sm_80: 164 KB) does not take the default ones at the CTAs per
SM their registers are sized for; a device that fits no variant is declined with the bytes needed
(explain() prints it), never launched into CUDA_ERROR_INVALID_VALUE. tests/test_kernels_fit.py checks the
same choices against ptxas's static shared memory.
"""

import dataclasses

import pytest

import cupa
from cupa import dispatch
from cupa.device import describe_capability
from cupa.kernels import decode, prefill
from tests.test_dispatch import problem_of

CAPS = [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]
SMALL = {(8, 6), (8, 9), (12, 0)}  # 99 KB per CTA, 100 KB per SM


@pytest.mark.parametrize("cc", CAPS)
def test_prefill_tiles(cc):
    device = describe_capability(*cc)
    for quantized in (False, True):
        assert prefill.tile_for(64, quantized, device) == (128, 64)
        assert prefill.tile_for(128, quantized, device) == ((128, 64) if cc in ((9, 0), (10, 0)) else (128, 32))
        assert prefill.tile_for(256, quantized, device) == ((64, 32) if cc in SMALL else (128, 32))
        for d in prefill.PREFILL_HEAD_SIZES:
            tile = prefill.tile_for(d, quantized, device)
            need = prefill.shared_bytes(d, quantized, tile) + prefill.static_shared_bound(d, tile)
            assert need <= device.shared_per_block_optin, (cc, d, tile, need)


def test_prefill_shared_bytes_mirror_the_kernel_layout():
    # Q 32 KB + 2 stages x (K + V) 32 KB + row offsets, sizes, masks + the alignment pad (PrefillSmem)
    assert prefill.shared_bytes(128, False, (128, 64)) == 32768 + 2 * 32768 + 3 * 64 * 12 + 3 * 2 * 4 + 128
    assert prefill.shared_bytes(128, False, (128, 64)) == 100760  # + 2672 B static: 103,432 > 101,376
    assert prefill.shared_bytes(256, False, (64, 32)) == 99596
    assert prefill.shared_bytes(128, True, (128, 32)) == 32768 + 2 * 8192 + 16384 + 3 * 32 * 12 + 3 * 4 + 128


@pytest.mark.parametrize("cc", CAPS)
def test_decode_stages(cc):
    device = describe_capability(*cc)
    for d in decode.MMA_HEAD_SIZES:
        for quantized in (False, True):
            stages = decode.mma_stages(d, quantized, device, 2)
            need = decode.mma_shared_bytes(d, quantized, stages)
            assert need <= device.shared_per_block_optin
            # the deepest pipeline that keeps 2 CTAs per SM
            deeper = [s for s in decode.MMA_STAGES if s > stages]
            assert all(decode.mma_shared_bytes(d, quantized, s) + 1024 > device.shared_per_sm // 2 for s in deeper)
    assert decode.mma_stages(128, False, describe_capability(9, 0), 2) == 3
    assert decode.mma_stages(128, False, describe_capability(8, 0), 2) == 2
    assert decode.mma_stages(128, True, describe_capability(8, 0), 2) == 3
    assert decode.mma_shared_bytes(128, False, 3) == 103424 and decode.mma_shared_bytes(128, False, 2) == 70400
    # the combine (m, l and o of 4 warps x 16 rows) fits in every variant
    assert decode.mma_shared_bytes(64, True, 2) >= 16 * 64 * 2 + 2 * 4 * 16 * 4 + 4 * 16 * 68 * 4


def test_explain_names_the_variant(rng):
    text = dispatch.account(problem_of(rng, q_lens=[1, 1], past=[100, 7], H=8, Hk=2, D=128),
                            describe_capability(8, 0), cupa.Options())
    assert "decode: chosen" in text and "2-stage K/V pipeline" in text, text
    text = dispatch.account(problem_of(rng, D=256), describe_capability(8, 6), cupa.Options())
    assert "prefill: chosen" in text and "tile of 64 " in text and "keys in tiles of 32 " in text, text


def test_declined_when_no_variant_fits(rng):
    tiny = dataclasses.replace(describe_capability(8, 6), shared_per_block_optin=48 * 1024, shared_per_sm=64 * 1024)
    prefill_problem = problem_of(rng, D=128)
    reasons = prefill.BACKEND.not_supported_reasons(prefill_problem, tiny, cupa.Options())
    assert any("paged_prefill needs" in r and "49152 B" in r for r in reasons), reasons
    decode_problem = problem_of(rng, q_lens=[1, 1], past=[100, 7], D=128)
    reasons = decode.BACKEND.not_supported_reasons(decode_problem, tiny, cupa.Options())
    assert any("paged_decode_mma needs 70400 B" in r for r in reasons), reasons
    # the general backend (CUDA cores) takes the call the fused backends decline, and explain() says why
    assert dispatch.choose(decode_problem, tiny, cupa.Options()).name == "general"
    assert "paged_decode_mma needs 70400 B" in dispatch.account(decode_problem, tiny, cupa.Options())
