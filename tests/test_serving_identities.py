"""Seed 9.3.5 and 17.2 identities, run through the serving toolkit.

Two drivers take the same requests with the same model; one uses the feature under test (a ring
or evicting window, prefix sharing, speculative rollback), the other does without. Every step both
run the same tokens in the same batch, so their outputs must agree bit for bit (one backend is
deterministic and a block table only says where keys live). The first driver is also checked
against dense attention over each sequence's history. The NumPy backend runs here; the CuPy
versions are marked ``gpu``.
"""

import numpy as np
import pytest

from cupa import serving
from tests.serving_cases import Driver, ToyModel, live_kv, same_bits

BACKENDS = [pytest.param("numpy", id="numpy"), pytest.param("cupy", marks=pytest.mark.gpu, id="cupy")]
H, HK, D = 4, 2, 16


@pytest.fixture(params=BACKENDS)
def xp(request):
    if request.param == "numpy":
        return np
    return pytest.importorskip("cupy")


def _twins(rng, xp, kinds_a, kinds_b, *, bs, num_blocks=200, prefix=(True, True), cache_dtype=None,
           quant="PER_TENSOR", sink=False, model_len=96, tokens=64, dtype="float32"):
    model = ToyModel(rng, len(kinds_a), H, HK, D, dtype, max_position=model_len)
    sinks = [(rng.standard_normal(H) * 2).astype(model.T) for _ in kinds_a] if sink else False
    scale_values = [(rng.uniform(0.02, 0.04, (HK, 1, D)).astype(np.float32) if quant == "PER_CHANNEL"
                     else np.float32([0.03]), np.float32([0.035])) for _ in kinds_a]
    drivers = []
    for kinds, pc in zip((kinds_a, kinds_b), prefix):
        drivers.append(Driver(rng, model, H, dict(layers=kinds, kv_num_heads=HK, head_size=D, dtype=dtype,
                                                  block_size=bs, num_blocks=num_blocks, cache_dtype=cache_dtype,
                                                  k_quant_type=quant, v_quant_type=quant),
                              dict(max_num_seqs=6, max_model_len=model_len, max_num_batched_tokens=tokens,
                                   enable_prefix_caching=pc),
                              xp=xp, sink=sinks, scales=lambda l: scale_values[l]))
    return drivers


def _step_both(a, b, tol=1e-5):
    sa, _, outs_a = a.step()
    sb, _, outs_b = b.step()
    assert sa.seq_ids == sb.seq_ids
    for l, (oa, ob) in enumerate(zip(outs_a, outs_b)):
        same_bits(oa, ob, f"layer {l} output (lengths {sa.seq_lens.tolist()})")
    a.check_dense(sa, outs_a, tol)
    a.m.check()
    b.m.check()
    return sa


def _decode_run(rng, a, b, prompts, steps, chunk, tol=1e-5):
    """Prefill ``prompts`` in chunks, then decode ``steps`` tokens per sequence, in both drivers."""
    vocab = a.model.emb.shape[1]
    todo = {}
    for s, n in enumerate(prompts):
        prompt = rng.integers(0, vocab, n).tolist()
        for d in (a, b):
            cached, rest = d.add(s, prompt)
            assert cached == 0
        todo[s] = rest
    past_window = 0
    while any(todo.values()):
        for s, rest in todo.items():
            if rest:
                for d in (a, b):
                    d.append(s, rest[:chunk])
                todo[s] = rest[chunk:]
        _step_both(a, b, tol)
    window = max(g.kind.window for g in a.cache.groups)
    for _ in range(steps):
        tokens = rng.integers(0, vocab, a.m.num_running)
        for d in (a, b):
            d.append_decode(tokens)
        step = _step_both(a, b, tol)
        past_window += bool((step.seq_lens > window).any())
    return past_window


@pytest.mark.parametrize("W,bs", [(8, 4), (5, 4), (16, 16), (3, 1), (7, 8)])
def test_ring_buffer_bit_identical_to_full_cache(rng, xp, W, bs):
    """Seed 9.3.5: ceil(W/bs)+1 blocks per sequence recycled through slot_mapping, entries below the
    window -1, equal to a cache that keeps everything, at every decode step past L > W; one batch
    mixes sequences past the window and sequences not there yet."""
    ring = serving.sliding_window(W, "ring", max_query_len=4)
    a, b = _twins(rng, xp, [ring], [serving.sliding_window(W, "keep")], bs=bs)
    steps = 3 * W + 4
    assert _decode_run(rng, a, b, prompts=[W + 3, 1, max(1, W // 2)], steps=steps, chunk=4) >= 2 * W
    n_ring = ring.ring_blocks(bs)
    assert a.m.num_used_blocks <= 3 * n_ring < b.m.num_used_blocks


def test_evicting_window_bit_identical_to_full_cache(rng, xp):
    W, bs = 9, 4
    a, b = _twins(rng, xp, [serving.full_attention(), serving.sliding_window(W, "evict")],
                  [serving.full_attention(), serving.sliding_window(W, "keep")], bs=bs)
    _decode_run(rng, a, b, prompts=[14, 2, 6], steps=20, chunk=5)
    window_blocks = [len([x for x in a.m.block_table(s, 1) if x >= 0]) for s in a.m.seq_ids]
    assert max(window_blocks) <= -(-W // bs) + 1
    assert a.m.num_used_blocks < b.m.num_used_blocks


def test_window_at_least_the_length_equals_full_attention(rng, xp):
    """W >= L with recycling on: nothing is ever evicted and the result is full attention's."""
    a, b = _twins(rng, xp, [serving.sliding_window(64, "ring", max_query_len=8)], [serving.full_attention()], bs=8)
    _decode_run(rng, a, b, prompts=[20, 5], steps=12, chunk=8)


@pytest.mark.parametrize("cache_dtype,quant", [("int8", "PER_CHANNEL"), ("float8e4m3fn", "PER_TENSOR"),
                                              ("int4", "PER_CHANNEL"), ("float4e2m1", "PER_TENSOR")])
def test_ring_buffer_quantized_cache_with_head_sink(rng, xp, cache_dtype, quant):
    W, bs = 6, 4
    a, b = _twins(rng, xp, [serving.sliding_window(W, "ring", max_query_len=3)], [serving.sliding_window(W, "keep")],
                  bs=bs, cache_dtype=cache_dtype, quant=quant, sink=True, dtype="float16")
    assert _decode_run(rng, a, b, prompts=[6, 2], steps=20, chunk=3, tol=2e-3) >= 10


@pytest.mark.parametrize("layers", ["full+evict", "full+ring"])
def test_shared_prefix_bit_identical_to_private_prefix(rng, xp, layers):
    """Seed 17.2: sequences mapping another's prefix blocks (no write for those tokens) equal the
    same sequences with private prefixes, step for step."""
    W, bs = 7, 4
    second = serving.sliding_window(W, "evict") if layers == "full+evict" else serving.sliding_window(W, "ring", 16)
    kinds = [serving.full_attention(), second]
    a, b = _twins(rng, xp, kinds, kinds, bs=bs, prefix=(True, False))
    vocab = a.model.emb.shape[1]
    system = rng.integers(0, vocab, 18).tolist()
    first = system + rng.integers(0, vocab, 3).tolist()
    for d in (a, b):
        d.append(0, d.add(0, first)[1])
    _step_both(a, b)
    shared_before = a.m.num_used_blocks
    for s in (1, 2):
        prompt = system + rng.integers(0, vocab, 2 + s).tolist()
        cached, rest = a.add(s, prompt)
        assert cached == (16 if layers == "full+evict" else 0)
        _, rest_b = b.add(s, prompt)
        if cached:                                      # b computes the same prefix privately first
            b.append(s, rest_b[:cached])
            b.step()
            rest_b = rest_b[cached:]
        assert rest_b == rest
        for d, r in ((a, rest), (b, rest_b)):
            d.append(s, r)
        _step_both(a, b)
        assert list(a.m.block_table(s, 0)[:4]) == list(a.m.block_table(0, 0)[:4])   # mapped, not copied
    for _ in range(8):
        tokens = rng.integers(0, vocab, a.m.num_running)
        for d in (a, b):
            d.append_decode(tokens)
        _step_both(a, b)
    assert a.m.num_used_blocks < b.m.num_used_blocks and shared_before > 0


def test_rollback_leaves_cache_and_outputs_as_if_rejected_tokens_never_came(rng, xp):
    """Speculative decoding: k drafts appended and run, a prefix accepted, the rest rolled back;
    the cache (every live slot) and every later step equal a run that only ever saw the accepted
    tokens."""
    W, bs, k = 6, 4, 3
    kinds = [serving.full_attention(), serving.sliding_window(W, "ring", max_query_len=k + 1),
             serving.sliding_window(W, "evict")]
    a, b = _twins(rng, xp, kinds, kinds, bs=bs)
    vocab = a.model.emb.shape[1]
    for s, n in enumerate((5, 9, 1)):
        prompt = rng.integers(0, vocab, n).tolist()
        for d in (a, b):
            d.append(s, d.add(s, prompt)[1])
    _step_both(a, b)
    rejected = 0
    for _ in range(10):
        accepted = {}
        for s in a.m.seq_ids:                            # a: the next token and k drafts; b: what survives
            tokens = rng.integers(0, vocab, k + 1).tolist()
            accepted[s] = tokens[:int(rng.integers(1, k + 2))]
            a.append(s, tokens)
            b.append(s, accepted[s])
        step, _, outs = a.step()
        a.check_dense(step, outs)                        # drafts attend like any token
        b.step()
        for s in a.m.seq_ids:
            a.rollback(s, k + 1 - len(accepted[s]))
            rejected += k + 1 - len(accepted[s])
            assert a.m.length(s) == b.m.length(s)
        a.m.check()
        for s in a.m.seq_ids:
            for layer in range(len(kinds)):
                assert live_kv(a, s, layer) == live_kv(b, s, layer), f"cache of {s} in layer {layer}"
        tokens = rng.integers(0, vocab, a.m.num_running)
        for d in (a, b):                                # a plain decode step: identical from here on
            d.append_decode(tokens)
        _step_both(a, b)
    assert rejected > 5
    # the hash chains survived the rollbacks: a prompt equal to sequence 0's history maps all its full blocks
    prompt = a.tokens[0] + [1]
    full = a.cache.group_of(0)
    for d in (a, b):
        cached, rest = d.add("x", prompt)
        assert cached == 0 and len(rest) == len(prompt)       # the ring group takes every token again
    n = len(a.tokens[0]) // bs
    assert list(a.m.block_table("x", full)[:n]) == list(a.m.block_table(0, full)[:n])
    for d in (a, b):
        d.append("x", prompt[:12])
    _step_both(a, b)
