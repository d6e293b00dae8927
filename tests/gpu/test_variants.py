"""The kernel variants chosen for GPUs with less shared memory, run on the device at hand.

Backend choice reads the DeviceInfo of the inputs' device; here it is given the shared-memory limits
(and compute capability) of an sm_86-class GPU (99 KB per CTA, 100 KB per SM) or of an A100 (163 KB
per CTA, 164 KB per SM) while the kernels run on the real device, so the compact prefill tiles
(128 x 32 at D=128, 64 x 32 at D=256) and the 2-stage tensor-core decode pipeline are checked
against the NumPy reference (every output element and cache byte, tests/util.py) on an H200.
"""

import dataclasses

import numpy as np
import pytest

import cupa
from cupa import api, dispatch
from cupa.device import describe_capability
from cupa.kernels import decode, prefill
from tests import util
from tests.gpu import test_nonfinite as nonfinite

pytestmark = pytest.mark.gpu


def limits_of(monkeypatch, capability):
    """Backend choice sees the real device with the limits of a GPU of ``capability`` (fresh ops)."""
    real = dispatch.device_info
    like = describe_capability(*capability)

    def device_info(ordinal):
        return dataclasses.replace(real(ordinal), capability=like.capability,
                                   shared_per_block_optin=like.shared_per_block_optin,
                                   shared_per_sm=like.shared_per_sm)

    monkeypatch.setattr(dispatch, "device_info", device_info)
    api._bound_op.cache_clear()
    return like


@pytest.fixture
def sm86(monkeypatch):
    yield limits_of(monkeypatch, (8, 6))
    api._bound_op.cache_clear()


@pytest.fixture
def sm80(monkeypatch):
    yield limits_of(monkeypatch, (8, 0))
    api._bound_op.cache_clear()


def explain(cp, inputs, attrs):
    return cupa.PagedAttention(**attrs).explain(**util.to_device(cp, inputs))


@pytest.mark.parametrize("D,tile", [(128, (128, 32)), (256, (64, 32))])
@pytest.mark.parametrize("dtype,cache", [("float16", "T"), ("bfloat16", "T"), ("float16", "int8"),
                                         ("bfloat16", "fp8")])
@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_compact_tiles(cp, rng, sm86, D, tile, dtype, cache, block_size):
    """The compact tiles on a 99 KB GPU: a ragged chunked prefill with a window and sinks (D=256 on 4 warps
    copies T rows in two swizzle phases)."""
    assert prefill.tile_for(D, cache != "T", sm86) == tile
    inputs, attrs = util.build(rng, q_lens=[150, 0, 77, 33], past=[40, 9, 0, 300], H=8, Hk=2, D=D, dtype=dtype,
                             cache=cache, block_size=block_size, window=200, sink=True)
    text = explain(cp, inputs, attrs)
    assert "prefill: chosen" in text and f"tile of {tile[0]} " in text and f"keys in tiles of {tile[1]} " in text, text
    util.check_against_reference(cp, inputs, attrs, dtype=dtype, cache=cache)


def test_prefill_compact_tile_on_sm_80(cp, rng, sm80):
    """On an A100 the D=128 default tile (103 KB) would leave one CTA per SM: the 128 x 32 tile runs two."""
    assert prefill.tile_for(128, False, sm80) == (128, 32) and prefill.tile_for(256, False, sm80) == (128, 32)
    inputs, attrs = util.build(rng, q_lens=[300, 45], past=[0, 700], H=16, Hk=4, D=128)
    assert "keys in tiles of 32 " in explain(cp, inputs, attrs)
    util.check_against_reference(cp, inputs, attrs)


@pytest.mark.parametrize("D,tile", [(128, (128, 32)), (256, (64, 32))])
def test_prefill_compact_tiles_keep_nonfinite_keys_out(cp, rng, sm86, D, tile):
    """Inf/NaN new V rows of the causal future inside a compact tile leave the earlier tokens' bits alone."""
    assert prefill.tile_for(D, False, sm86) == tile
    clean, attrs = util.build(rng, q_lens=[150, 97], past=[0, 0], H=16, Hk=4, D=D)
    bad = {0: [37, 100], 1: [20]}
    poisoned = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in clean.items()}
    cum = clean["cumulative_sequence_length"]
    for b, positions in bad.items():
        for k in positions:
            poisoned["value"][cum[b] + k] = np.nan
    assert nonfinite.check_isolated(cp, clean, poisoned, attrs, bad, "prefill") > 50


@pytest.mark.parametrize("capability,D,cache,H,Hk", [
    ((8, 0), 128, "T", 16, 2),      # A100: 3 stages (103 KB) would leave 1 CTA per SM
    ((8, 6), 128, "T", 32, 8),      # 99 KB per CTA: 3 stages do not fit
    ((8, 6), 64, "T", 8, 2),        # 2 CTAs per SM instead of 1
    ((8, 6), 128, "int8", 16, 2),   # 8-bit, keys as M (8 heads per CTA)
    ((8, 6), 128, "fp8", 32, 2),    # 8-bit, head-major loop (16 heads per CTA)
])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_decode_two_stage_pipeline(cp, rng, monkeypatch, capability, D, cache, H, Hk, dtype):
    """The 2-stage tensor-core decode pipeline, chosen where 3 stages do not fit or halve the CTAs per SM:
    splits, a window, softcap and sinks, ragged lengths, block sizes 16 and 1."""
    like = limits_of(monkeypatch, capability)
    try:
        assert decode.mma_stages(D, cache != "T", like, 2) == 2
        for block_size in (16, 1):
            inputs, attrs = util.build(rng, B=6, H=H, Hk=Hk, D=D, dtype=dtype, cache=cache, block_size=block_size,
                                     past=[2000, 1, 63, 64, 700, 130], window=1000, softcap=30.0, sink=True)
            text = explain(cp, inputs, attrs)
            assert "decode: chosen" in text and "2-stage K/V pipeline" in text, text
            util.check_against_reference(cp, inputs, attrs, dtype=dtype, cache=cache)
    finally:
        api._bound_op.cache_clear()
