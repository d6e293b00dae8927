"""Packed 4-bit caches (int4, float4 e2m1) on the GPU against the NumPy reference (contract §4.1, §6).

The decode backend (tensor-core loops for fp16/bf16 and head_size 64/128: keys as M for GQA groups of
<= 8 heads, head-major for larger ones; the CUDA-core kernel for fp32 and other head sizes) and the
prefill backend, each selected by name, and the default choice. Every run draws fresh random
data, poisons the output with NaN, checks every output element against the reference (the
reference attends over the dequantized codes, so the contract's tolerance applies as for any
cache) and requires the written cache bytes to equal the reference's exactly.

    python -m pytest -m gpu tests/gpu/test_subbyte.py
"""

import numpy as np
import pytest

import cupa
from cupa.kernels import decode, prefill
from tests import gpu_cases as gc

pytestmark = pytest.mark.gpu

#: (K kind, V kind): one packed kind for both caches, or the two mixed
PAIRS = [("int4", None), ("fp4", None), ("int4", "fp4"), ("fp4", "int4")]
QUANTS = [("PER_TENSOR", "PER_TENSOR"), ("PER_CHANNEL", "PER_CHANNEL"), ("PER_TENSOR", "PER_CHANNEL")]


def run_named(cp, name, inputs, attrs, *, dtype, cache, v_cache=None, metadata=None):
    """The call through ``Options(backend=name)`` against the reference (gc.check_against_reference: NaN-poisoned
    out, every element, exact packed cache bytes); returns (plan, device output)."""
    named = gc.with_options(attrs, backend=name)
    op = cupa.PagedAttention(**named)
    plan = op.plan(**gc.to_device(cp, inputs))
    assert plan.backend.name == name and plan.problem.packed
    out, _ = gc.check_against_reference(cp, inputs, named, metadata=metadata, dtype=dtype, cache=cache,
                                        v_cache=v_cache)
    return plan, out


# ---- decode -----------------------------------------------------------------------------

@pytest.mark.parametrize("cache,v_cache", PAIRS)
@pytest.mark.parametrize("kq,vq", QUANTS)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_decode_mma_keys_as_m(cp, rng, cache, v_cache, kq, vq, D, dtype):
    """GQA 8/2 (groups of 4 heads): the tensor-core loop with keys as the MMA's M dimension."""
    inputs, attrs = gc.build(rng, B=5, H=8, Hk=2, D=D, dtype=dtype, cache=cache, v_cache=v_cache, k_quant=kq,
                             v_quant=vq, past=[1, 15, 16, 700, 2100])
    plan, _ = run_named(cp, "decode", inputs, attrs, dtype=dtype, cache=cache, v_cache=v_cache)
    assert decode.uses_mma(plan.problem) and decode.uses_keys_as_m(plan.problem, plan.options)


@pytest.mark.parametrize("cache,v_cache", PAIRS)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H,Hk", [(16, 1), (32, 2)])
def test_decode_mma_head_major(cp, rng, cache, v_cache, D, H, Hk):
    """Groups of 16 query heads: the head-major tensor-core loop, with softcap, a window and sinks."""
    inputs, attrs = gc.build(rng, B=3, H=H, Hk=Hk, D=D, cache=cache, v_cache=v_cache, softcap=25.0, window=300,
                             sink=True, past=[900, 40, 2500])
    plan, _ = run_named(cp, "decode", inputs, attrs, dtype="float16", cache=cache, v_cache=v_cache)
    assert decode.uses_mma(plan.problem) and not decode.uses_keys_as_m(plan.problem, plan.options)


@pytest.mark.parametrize("cache,v_cache", PAIRS)
@pytest.mark.parametrize("dtype,D", [("float32", 128), ("float32", 64), ("float16", 256), ("bfloat16", 72),
                                     ("float16", 8)])
def test_decode_cuda_cores(cp, rng, cache, v_cache, dtype, D):
    """fp32 activations and head sizes the tensor-core loop does not take: the CUDA-core kernel (8 codes a
    lane, one 4-byte load)."""
    inputs, attrs = gc.build(rng, B=4, H=8, Hk=2, D=D, dtype=dtype, cache=cache, v_cache=v_cache,
                             k_quant="PER_CHANNEL", v_quant="PER_TENSOR", past=[3, 300, 1100, 64])
    plan, _ = run_named(cp, "decode", inputs, attrs, dtype=dtype, cache=cache, v_cache=v_cache)
    assert not decode.uses_mma(plan.problem)


@pytest.mark.parametrize("cache", ["int4", "fp4"])
@pytest.mark.parametrize("block_size", [1, 7, 16, 64])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_decode_block_sizes(cp, rng, cache, block_size, dtype):
    """Block sizes 1, odd, 16 and 64 with shuffled and unmapped block-table entries, rotary and QK-norm in the
    prologue before the 4-bit write."""
    inputs, attrs = gc.build(rng, B=4, H=8, Hk=2, D=128, dtype=dtype, cache=cache, block_size=block_size,
                             block_table="unmapped", rotary=True, qk_norm=True, past=[70, 1, 33, 400])
    run_named(cp, "decode", inputs, attrs, dtype=dtype, cache=cache)


@pytest.mark.parametrize("cache", ["int4", "fp4"])
def test_decode_ragged_through_the_decode_backend(cp, rng, cache):
    """Several tokens per sequence, a zero-token sequence and explicit slots (some skipped)."""
    inputs, attrs = gc.build(rng, q_lens=[3, 0, 9, 1], past=[40, 7, 0, 1200], H=8, Hk=2, D=128, cache=cache,
                             window=100, sink=True)
    slots = gc.derived_slots(inputs, 16)
    slots[1] = -1
    inputs["slot_mapping"] = np.asarray(slots, dtype=np.int32)
    run_named(cp, "decode", inputs, attrs, dtype="float16", cache=cache)


@pytest.mark.parametrize("name,q_lens", [("decode", [1, 1, 1, 1]), ("prefill", [30, 0, 17, 64])])
def test_bit_identical_runs_and_bounds(cp, rng, name, q_lens):
    """Two runs give the same bits (contract §4.5), and so do tight, loose and absent attention_metadata."""
    inputs, attrs = gc.build(rng, q_lens=q_lens, past=[500, 3, 0, 70], H=8, Hk=2, D=128, cache="fp4",
                             v_cache="int4")
    named = gc.with_options(attrs, backend=name)
    kv = [p + q for p, q in zip([500, 3, 0, 70], q_lens)]
    outs = []
    for md in (None, None, (max(q_lens), max(kv)), (4 * max(q_lens), 8 * max(kv))):
        dev = gc.to_device(cp, inputs)
        md = None if md is None else np.array(md, dtype=np.int32)
        outs.append(cp.asnumpy(cupa.paged_attention(**dev, attention_metadata=md, **named)))
    for o in outs[1:]:
        assert np.array_equal(o.view(np.uint16), outs[0].view(np.uint16))


# ---- prefill ----------------------------------------------------------------------------

@pytest.mark.parametrize("cache,v_cache", PAIRS)
@pytest.mark.parametrize("kq,vq", QUANTS)
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_prefill(cp, rng, cache, v_cache, kq, vq, D, dtype):
    """A prefill without a past (ragged lengths, a zero-token sequence): the row tiles over 4-bit K/V tiles
    widened in shared memory."""
    inputs, attrs = gc.build(rng, q_lens=[70, 0, 129, 5], past=[0, 0, 0, 0], H=8, Hk=2, D=D, dtype=dtype,
                             cache=cache, v_cache=v_cache, k_quant=kq, v_quant=vq)
    run_named(cp, "prefill", inputs, attrs, dtype=dtype, cache=cache, v_cache=v_cache)


@pytest.mark.parametrize("cache,v_cache", PAIRS)
@pytest.mark.parametrize("block_size", [1, 5, 16, 256])
def test_chunked_prefill(cp, rng, cache, v_cache, block_size):
    """New chunks after a cached past (chunked prefill): causal within the chunk, the past read from the
    4-bit pages, a window and head sinks, odd and large block sizes."""
    inputs, attrs = gc.build(rng, q_lens=[64, 17, 1, 130], past=[200, 0, 33, 1000], H=16, Hk=2, D=128,
                             cache=cache, v_cache=v_cache, block_size=block_size, window=700, sink=True)
    run_named(cp, "prefill", inputs, attrs, dtype="float16", cache=cache, v_cache=v_cache)


@pytest.mark.parametrize("cache", ["int4", "fp4"])
def test_prefill_packed_qkv_rotary_positions(cp, rng, cache):
    """Packed QKV, rotary and QK-norm, explicit query_positions, GQA 32/8."""
    inputs, attrs = gc.build(rng, q_lens=[40, 23], past=[17, 300], H=32, Hk=8, D=128, dtype="bfloat16",
                             cache=cache, packed=True, rotary=True, qk_norm=True, query_positions=True)
    plan, _ = run_named(cp, "prefill", inputs, attrs, dtype="bfloat16", cache=cache)
    assert prefill.tile_for(128, True, plan.device, packed=True) is not None


# ---- the gate ---------------------------------------------------------------------------

def test_auto_chooses_the_packed_kernels(cp, rng):
    """Options(backend="auto") runs a packed-cache call on the decode (or prefill) backend."""
    inputs, attrs = gc.build(rng, H=8, Hk=2, D=128, cache="int4")
    dev = gc.to_device(cp, inputs)
    op = cupa.PagedAttention(**gc.host_attrs(attrs))
    assert op.plan(**dev).backend.name == "decode"
    gc.check_against_reference(cp, inputs, gc.host_attrs(attrs), cache="int4")
