"""Random paged problems for the GPU tests, and the comparison against the NumPy reference.

``build`` makes NumPy inputs (fresh random data, never zeros); ``check_against_reference`` runs
the reference on one copy and the CUDA path on CuPy copies with a NaN-poisoned ``out=``, then
checks every output element (contract §6 tolerances) and every cache byte.
"""

from __future__ import annotations

import contextlib
import math

import ml_dtypes
import numpy as np

import cupa

NP_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
#: The cupa.Options every case of :func:`build` runs with (its attrs carry them); a test module's fixture
#: sets it (monkeypatch) to run its cases with another backend or launch route.
OPTIONS = None
from cupa.contract import TOLERANCE  # noqa: E402  (the one tolerance table, contract §6)
#: k/v_cache_dtype of each quantized cache kind of :func:`build`, and its largest code (what scales are sized by)
CACHE_DTYPE = {"int8": "int8", "fp8": "float8e4m3fn", "int4": "int4", "fp4": "float4e2m1"}
CACHE_QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 7.0, "fp4": 6.0}
#: the packed 4-bit cache kinds (two codes a byte): their written bytes must equal the reference's
PACKED_KINDS = ("int4", "fp4")


def build(rng, *, B=4, H=8, Hk=2, D=64, block_size=16, dtype="float16", q_lens=None, past=None,
          max_blocks=None, cache="T", k_quant="PER_CHANNEL", v_quant="PER_CHANNEL", packed=False,
          rotary=False, interleaved=False, rotary_dim=None, rotary_offset=0, qk_norm=False, sink=False,
          softcap=0.0, window=-1, is_causal=1, slot_mapping=None, query_positions=False, block_table="shuffled",
          spare_blocks=3, bias=None, bias_pad=(0, 0), bias_neg_inf=0.0, qk_output=0, return_lse=False,
          latent=False, v_head_size=0, scale=0.0, v_cache=None):
    """NumPy inputs + attributes of a random paged problem (decode-shaped by default).

    ``bias``: None or (batch_broadcast, head_broadcast), an attention_bias of shape (1 or B, 1 or H,
    max q_len + bias_pad[0], max kv_len + bias_pad[1]) (a negative pad makes a capacity smaller than
    needed); ``bias_neg_inf``: the fraction of its entries set to -inf, and then also all of entry
    (0, 0, 0, :) (the first query row of sequence 0, head 0 admits no finite key). ``qk_output``,
    ``return_lse``, ``scale``: the attributes. ``latent``: the LATENT layout (kv_num_heads 1, one cache,
    ``v_head_size`` channels of V; give ``scale`` when v_head_size != D). ``cache``: "T", "int8", "fp8",
    or the packed 4-bit "int4" / "fp4" (uint8 caches of last dimension D / 2); ``v_cache``: value_cache's
    kind where it differs (the other packed 4-bit kind).
    """
    T = NP_DTYPES[dtype]
    if latent:
        Hk, packed = 1, False
    q_lens, past, kv_lens, N, cum, bt, num_blocks = random_sequences(rng, B, q_lens, past, block_size, max_blocks,
                                                                     block_table, spare_blocks)
    B = len(q_lens)

    def act(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(T)

    attrs = dict(num_heads=H, kv_num_heads=Hk, softcap=softcap, local_window_size=window, is_causal=is_causal)
    if OPTIONS is not None:
        attrs["options"] = OPTIONS
    for name, value, default in (("qk_output", qk_output, 0), ("return_lse", return_lse, False), ("scale", scale, 0.0)):
        if value != default:
            attrs[name] = value
    if latent:
        attrs["kv_cache_layout"] = "LATENT"
        if v_head_size:
            attrs["v_head_size"] = v_head_size
    inputs = {}
    if packed:
        inputs["query"] = act(N, (H + 2 * Hk) * D)
    elif latent:
        inputs["query"], inputs["key"] = act(N, H * D), act(N, D)
    else:
        inputs["query"], inputs["key"], inputs["value"] = act(N, H * D), act(N, Hk * D), act(N, Hk * D)
    cshape = (num_blocks, block_size, Hk, D)
    if cache == "T":
        inputs["key_cache"] = act(*cshape)
        if not latent:
            inputs["value_cache"] = act(*cshape)
    else:
        kinds = (("k", k_quant, cache),) if latent else (("k", k_quant, cache), ("v", v_quant, v_cache or cache))
        for which, qt, kind in kinds:
            sshape = (1,) if qt == "PER_TENSOR" else (Hk, 1, D)
            scale = (rng.uniform(0.5, 1.5, size=sshape) * 3.0 / CACHE_QMAX[kind]).astype(np.float32)
            inputs[f"{which}_scale"] = scale
            values = rng.standard_normal(cshape).astype(np.float32)
            codes = cupa.quantize(values, scale, CACHE_DTYPE[kind], as_bytes=(kind != "int8"))
            inputs["key_cache" if which == "k" else "value_cache"] = codes
            attrs[f"{which}_quant_type"] = qt
            if kind != "int8":
                attrs[f"{which}_cache_dtype"] = CACHE_DTYPE[kind]
    inputs["cumulative_sequence_length"] = cum
    inputs["past_seqlens"] = np.asarray(past, dtype=np.int32)
    inputs["block_table"] = bt
    if rotary:
        rd = rotary_dim or D
        max_pos = max(kv_lens) + 8
        cos, sin = cupa.rope_cache(max_pos, rd, dtype=T)
        inputs["cos_cache"], inputs["sin_cache"] = cos, sin
        attrs.update(do_rotary=1, rotary_interleaved=int(interleaved), rotary_offset=rotary_offset)
    if qk_norm:
        inputs["q_norm_weight"] = (1.0 + 0.2 * rng.standard_normal(D)).astype(T)
        inputs["k_norm_weight"] = (1.0 + 0.2 * rng.standard_normal(D)).astype(T)
    if sink:
        inputs["head_sink"] = act(H, scale=2.0)
    if slot_mapping is not None:
        inputs["slot_mapping"] = np.asarray(slot_mapping, dtype=np.int32)
    if query_positions:
        pos = np.concatenate([np.arange(p, p + q) for p, q in zip(past, q_lens)]).astype(np.int32)
        inputs["query_positions"] = pos
    if bias is not None:
        batch_broadcast, head_broadcast = bias
        shape = (1 if batch_broadcast else B, 1 if head_broadcast else H, max(1, max(q_lens) + bias_pad[0]),
                 max(1, max(kv_lens) + bias_pad[1]))
        values = rng.standard_normal(shape) * 2.0
        if bias_neg_inf:
            values[rng.random(shape) < bias_neg_inf] = -np.inf
            values[0, 0, 0, :] = -np.inf
        inputs["attention_bias"] = values.astype(T)
    return inputs, attrs


def random_sequences(rng, B, q_lens, past, block_size, max_blocks, block_table, spare_blocks):
    """Lengths, cumulative_sequence_length and a block table drawn from a shuffled pool (``block_table``:
    "shuffled", "shared" (sequence 1 shares sequence 0's first block) or "unmapped" (evicted and out-of-range
    entries)). Returns (q_lens, past, kv_lens, N, cum, block_table, num_blocks)."""
    q_lens = list(q_lens) if q_lens is not None else [1] * B
    B = len(q_lens)
    past = list(past) if past is not None else [int(x) for x in rng.integers(1, 200, size=B)]
    kv_lens = [p + q for p, q in zip(past, q_lens)]
    need = [math.ceil(kv / block_size) for kv in kv_lens]
    max_blocks = max_blocks or max(max(need), 1) + 2
    num_blocks = sum(need) + spare_blocks
    N = sum(q_lens)
    cum = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)

    perm = rng.permutation(num_blocks).astype(np.int32)
    bt = np.full((B, max_blocks), -1, dtype=np.int32)
    used = 0
    for b in range(B):
        bt[b, :need[b]] = perm[used:used + need[b]]
        used += need[b]
    if block_table == "shared" and B > 1 and need[0] > 1 and need[1] > 1:
        # sequence 1 shares sequence 0's first block (a shared prefix)
        bt[1, 0] = bt[0, 0]
    if block_table == "unmapped":
        for b in range(B):
            if need[b] > 2:
                bt[b, 0] = -1  # evicted: masked on read
        bt[0, min(1, max_blocks - 1)] = num_blocks + 7 if need[0] > 1 else bt[0, 0]  # out of range: masked
    return q_lens, past, kv_lens, N, cum, bt, num_blocks


#: Absorbed MLA (LATENT): kv_lora_rank + qk_rope_head_dim latent channels, V = the first kv_lora_rank.
MLA_D, MLA_DV, MLA_ROPE = 576, 512, 64
#: DeepSeek's softmax scale before YaRN: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) = 1/sqrt(192) (seed 12.6).
MLA_SCALE = 1.0 / math.sqrt(192.0)


def build_latent(rng, *, B=4, H=16, block_size=64, dtype="float16", q_lens=None, past=None, max_blocks=None,
                 cache="T", k_quant="PER_CHANNEL", rotary=False, interleaved=False, softcap=0.0, window=-1,
                 is_causal=1, slot_mapping=None, query_positions=False, block_table="shuffled", spare_blocks=3,
                 scale=MLA_SCALE, return_lse=False):
    """NumPy inputs + attributes of a random absorbed-MLA problem (kv_cache_layout LATENT, decode-shaped by
    default): query (N, H*576), key (N, 576) the new latent rows, key_cache (num_blocks, block_size, 1, 576)
    of T or fp8 codes (uint8 bytes, k_scale PER_TENSOR or PER_CHANNEL), v_head_size 512, an explicit scale,
    and with ``rotary`` RoPE on channels 512..575 (rotary_offset 512)."""
    T = NP_DTYPES[dtype]
    q_lens, past, kv_lens, N, cum, bt, num_blocks = random_sequences(rng, B, q_lens, past, block_size, max_blocks,
                                                                     block_table, spare_blocks)
    D = MLA_D
    attrs = dict(num_heads=H, kv_num_heads=1, kv_cache_layout="LATENT", v_head_size=MLA_DV, scale=scale,
                 softcap=softcap, local_window_size=window, is_causal=is_causal, return_lse=return_lse)
    if OPTIONS is not None:
        attrs["options"] = OPTIONS
    inputs = {"query": rng.standard_normal((N, H * D)).astype(T), "key": rng.standard_normal((N, D)).astype(T)}
    cshape = (num_blocks, block_size, 1, D)
    if cache == "T":
        inputs["key_cache"] = rng.standard_normal(cshape).astype(T)
    else:
        sshape = (1,) if k_quant == "PER_TENSOR" else (1, 1, D)
        k_scale = (rng.uniform(0.5, 1.5, size=sshape) * 3.0 / 448.0).astype(np.float32)
        inputs["k_scale"] = k_scale
        inputs["key_cache"] = cupa.quantize(rng.standard_normal(cshape).astype(np.float32), k_scale, "float8e4m3fn",
                                            as_bytes=True)
        attrs.update(k_quant_type=k_quant, k_cache_dtype="float8e4m3fn")
    inputs["cumulative_sequence_length"] = cum
    inputs["past_seqlens"] = np.asarray(past, dtype=np.int32)
    inputs["block_table"] = bt
    if rotary:
        cos, sin = cupa.rope_cache(max(kv_lens) + 8, MLA_ROPE, dtype=T)
        inputs["cos_cache"], inputs["sin_cache"] = cos, sin
        attrs.update(do_rotary=1, rotary_interleaved=int(interleaved), rotary_offset=MLA_DV)
    if slot_mapping is not None:
        inputs["slot_mapping"] = np.asarray(slot_mapping, dtype=np.int32)
    if query_positions:
        inputs["query_positions"] = np.concatenate([np.arange(p, p + q) for p, q in zip(past, q_lens)]).astype(np.int32)
    return inputs, attrs


def poison_unused_cache_rows(inputs, block_size, window=-1):
    """NaN in every cache row no sequence reads (positions past each sequence's keys, unmapped and spare
    blocks; fp8 codes 0x7F, int8 codes 127): rows a kernel loads but masks must not reach the output
    (0 * NaN). With a causal ``window`` (default positions), also the rows before every window of a
    sequence (positions <= past - window). Returns how many rows were poisoned."""
    cum, past, bt = inputs["cumulative_sequence_length"], inputs["past_seqlens"], inputs["block_table"]
    num_blocks = inputs["key_cache"].shape[0]
    unused = np.ones(num_blocks * block_size, dtype=bool)
    for b in range(len(past)):
        first = max(0, int(past[b]) - window + 1) if window > 0 else 0  # the first query's window start
        for pos in range(first, int(past[b]) + int(cum[b + 1] - cum[b])):
            blk = int(bt[b, pos // block_size])
            if 0 <= blk < num_blocks:
                unused[blk * block_size + pos % block_size] = False
    for name in ("key_cache", "value_cache"):
        if inputs.get(name) is None:  # (LATENT: one cache)
            continue
        rows = inputs[name].reshape(num_blocks * block_size, -1)
        if rows.dtype == np.uint8:    # fp8 e4m3 codes as bytes: 0x7F is NaN
            rows[unused] = 0x7F
        elif rows.dtype == np.int8:   # int8 codes have no NaN: the largest code instead
            rows[unused] = 127
        else:
            rows[unused] = np.nan
    return int(unused.sum())


def derived_slots(inputs, block_size):
    """The slots the derived rule would write (for building explicit slot_mapping tests)."""
    cum, past, bt = inputs["cumulative_sequence_length"], inputs["past_seqlens"], inputs["block_table"]
    slots = []
    for b in range(len(past)):
        for j in range(cum[b + 1] - cum[b]):
            p = past[b] + j
            slots.append(int(bt[b, p // block_size]) * block_size + p % block_size)
    return slots


def to_device(cp, inputs):
    return {k: (cp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}


def rel_error(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0))


def assert_cache_close(got, ref, kind, dtype, name):
    """T caches within one ulp of T; 8-bit caches within one code; packed 4-bit caches byte for byte (the
    prologue encodes in fp32 what the reference encodes in float32: the same codes)."""
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape, f"{name}: shape {got.shape}, expected {ref.shape}"
    if got.size == 0:       # an empty cache: nothing to compare
        return
    if kind in PACKED_KINDS:
        differ = got.view(np.uint8) != ref.view(np.uint8)
        assert not differ.any(), (f"{name}: {int(differ.sum())} of {got.size} {kind} bytes differ from the "
                                  f"reference's; first at {np.argwhere(differ)[0].tolist()}")
    elif kind == "T":
        # contract §4.1 has the GPU prologue compute in fp32: where the two terms of a rotated pair
        # cancel, fp32 cannot land within one ulp of T of the float64 result. The bound is one ulp
        # of T at the value plus a few fp32 roundings of the row's magnitude (the operands' size).
        g64, r64 = got.astype(np.float64), ref.astype(np.float64)
        row_max = np.abs(r64).max(axis=-1, keepdims=True)
        if dtype == "float16":
            ulp = np.spacing(np.abs(ref.astype(np.float16))).astype(np.float64)
        elif dtype == "bfloat16":
            _, e = np.frexp(np.abs(r64))
            ulp = np.ldexp(1.0, e - 8)
        else:
            ulp = np.abs(np.spacing(np.abs(ref.astype(np.float32)))).astype(np.float64)
        allowed = ulp * 1.0001 + 4.0 * 2.0 ** -24 * row_max
        bad = np.abs(g64 - r64) > allowed
        assert not bad.any(), f"{name}: {bad.sum()} cache values off by more than one ulp (+ fp32 rounding)"
    elif kind == "int8":
        diff = np.abs(got.astype(np.int32) - ref.astype(np.int32))
        assert diff.max() <= 1, f"{name}: int8 codes differ by {diff.max()}"
    else:
        def ordered(c):
            c = c.view(np.uint8).astype(np.int32)
            mag = c & 0x7F
            return np.where(c & 0x80, -mag, mag)
        diff = np.abs(ordered(got) - ordered(ref))
        assert diff.max() <= 1, f"{name}: fp8 codes differ by {diff.max()} steps"


def host_attrs(attrs: dict) -> dict:
    """``attrs`` for the NumPy reference: without the Options of a CUDA backend."""
    return {k: v for k, v in attrs.items() if k != "options"}


def with_options(attrs: dict, **changes) -> dict:
    """``attrs`` whose Options (``cupa.Options()`` if none) have ``changes`` applied."""
    import dataclasses

    return dict(attrs, options=dataclasses.replace(attrs.get("options") or cupa.Options(), **changes))


def check_against_reference(cp, inputs, attrs, *, metadata=None, dtype="float16", cache="T", stream=None,
                            v_cache=None):
    """Run reference and CUDA on the same inputs; check output and caches (``v_cache``: value_cache's kind
    where it differs from ``cache``). Returns the device output."""
    ref_in = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
    ref = cupa.paged_attention(**ref_in, attention_metadata=metadata, **host_attrs(attrs))
    dev = to_device(cp, inputs)
    out = cp.full(ref.shape, np.nan, dtype=dev["query"].dtype)
    got = cupa.paged_attention(**dev, attention_metadata=metadata, out=out, stream=stream, **attrs)
    assert got is out or got.data.ptr == out.data.ptr
    cp.cuda.get_current_stream().synchronize()
    host = cp.asnumpy(out)
    assert not np.isnan(host.astype(np.float32)).any(), "output has unwritten (NaN-poisoned) elements"
    err = rel_error(host, ref)
    assert err < TOLERANCE[dtype], f"relative error {err:.3g} >= {TOLERANCE[dtype]}"
    assert_cache_close(cp.asnumpy(dev["key_cache"]), ref_in["key_cache"], cache, dtype, "key_cache")
    assert_cache_close(cp.asnumpy(dev["value_cache"]), ref_in["value_cache"], v_cache or cache, dtype, "value_cache")
    return out, dev


def check_graph_capture(cp, inputs, attrs, metadata):
    """Capture one call into a CUDA graph on a CuPy stream, replay it, compare with the reference.

    Capture fails on any host synchronization, so this is the proof that a call has none.
    """
    ref_in = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
    ref = cupa.paged_attention(**ref_in, **host_attrs(attrs))
    dev = to_device(cp, inputs)
    N, H, D = inputs["query"].shape[0], attrs["num_heads"], inputs["key_cache"].shape[-1]
    out = cp.full((N, H * D), np.nan, dtype=dev["query"].dtype)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        cupa.paged_attention(**to_device(cp, inputs), out=cp.empty_like(out), **attrs)  # compile first
        stream.synchronize()
        stream.begin_capture()
        cupa.paged_attention(**dev, out=out, attention_metadata=metadata, **attrs)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    assert rel_error(cp.asnumpy(out), ref) < TOLERANCE[np.dtype(inputs["query"].dtype).name]


def build_prefix_written_this_call(rng, **kw):
    """A ragged prefill whose new tokens are read back, in the same call, as another sequence's past.

    Sequence 0 has no past and writes its first 16 new tokens into its block 0; sequence 1 maps its
    logical block 0 to that same block (a shared prefix) and has a past of 16, so its attention reads
    positions 0..15 from rows this call writes (contract §4.1: every write lands before any read).
    Sequences 2 and 3 are a zero-token one with a past and one without a past.
    """
    inputs, attrs = build(rng, q_lens=[40, 10, 0, 33], past=[0, 16, 5, 0], block_size=16, **kw)
    inputs["block_table"][1, 0] = inputs["block_table"][0, 0]
    return inputs, attrs


def check_new_keys_from_inputs(cp, inputs, attrs, *, backend, dtype="float16", metadata=None, beside=False):
    """The prefill reading new K/V from key/value (prefill.kv_from_inputs; explain() says so, and whether
    the prologue runs beside the attention kernel on SMs of its own) against the reference, then bit
    for bit against the same call with that off (Options(new_kv_from_inputs=False)): output, key cache
    and value cache."""
    def explain(a):
        return cupa.PagedAttention(**a).explain(**to_device(cp, inputs), attention_metadata=metadata)

    text = explain(attrs)
    assert f"{backend}: chosen" in text and "new K/V read from key/value" in text, text
    assert ("SMs of its own" in text) == beside, text
    out_on, dev_on = check_against_reference(cp, inputs, attrs, dtype=dtype, metadata=metadata)
    off = with_options(attrs, new_kv_from_inputs=False)
    assert "new K/V read from key/value" not in explain(off)
    out_off, dev_off = check_against_reference(cp, inputs, off, dtype=dtype, metadata=metadata)
    for name, a, b in (("output", out_on, out_off), ("key_cache", dev_on["key_cache"], dev_off["key_cache"]),
                       ("value_cache", dev_on["value_cache"], dev_off["value_cache"])):
        a, b = cp.asnumpy(a), cp.asnumpy(b)
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), f"{name}: bits differ with new_kv_from_inputs off"


def check_new_keys_cases(cp, rng, *, backend, dtype, head_sizes):
    """check_new_keys_from_inputs on: a call without a past (each head size), one whose new rows are
    another sequence's past in the same call (that CTA waits for the prologue; D=128), and one with
    enough tokens and bounds without a past, where the prologue runs beside the attention kernel (its
    512-thread token-loop variant on SMs of its own; the first head size)."""
    for D in head_sizes:
        inputs, attrs = build(rng, q_lens=[70, 0, 130], past=[0, 0, 0], H=8, Hk=2, D=D, dtype=dtype)
        check_new_keys_from_inputs(cp, inputs, attrs, backend=backend, dtype=dtype)
    inputs, attrs = build_prefix_written_this_call(rng, H=8, Hk=2, D=128, dtype=dtype)
    check_new_keys_from_inputs(cp, inputs, attrs, backend=backend, dtype=dtype)
    inputs, attrs = build(rng, q_lens=[1100, 0, 1000], past=[0, 0, 0], H=4, Hk=2, D=head_sizes[0], dtype=dtype)
    check_new_keys_from_inputs(cp, inputs, attrs, backend=backend, dtype=dtype,
                               metadata=np.array([1100, 1100], dtype=np.int32), beside=True)


@contextlib.contextmanager
def poisoned_allocations(cp):
    """Every device allocation made inside (outputs the call allocates itself: output_qk, lse; its workspaces)
    starts as 0xFF bytes, NaN in float32 and in 16-bit floats, so an element no kernel writes shows."""
    pool = cp.get_default_memory_pool()

    def malloc(nbytes):
        mem = pool.malloc(nbytes)
        if nbytes:
            cp.cuda.runtime.memsetAsync(mem.ptr, 0xFF, nbytes, cp.cuda.get_current_stream().ptr)
        return mem

    with cp.cuda.using_allocator(malloc):
        yield


def split_outputs(result, attrs) -> tuple:
    """``(output, output_qk or None, lse or None)`` of a call's result."""
    if not attrs.get("qk_output") and not attrs.get("return_lse"):
        return result, None, None
    rest = list(result[1:])
    qk = rest.pop(0) if attrs.get("qk_output") else None
    lse = rest.pop(0) if attrs.get("return_lse") else None
    return result[0], qk, lse


def assert_elementwise(got, ref, tol, name, floor=1.0):
    """Every element of ``got`` written (no NaN), -inf exactly where ``ref`` is -inf, and elsewhere within
    ``tol`` of ``ref`` relative to max(|ref|, floor)."""
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{name}: shape {got.shape}, expected {ref.shape}"
    assert not np.isnan(got).any(), f"{name}: {int(np.isnan(got).sum())} unwritten (NaN-poisoned) or NaN elements"
    neg = np.isneginf(ref)
    assert np.array_equal(np.isneginf(got), neg), f"{name}: -inf at {int((np.isneginf(got) != neg).sum())} wrong places"
    finite = ~neg
    err = np.abs(got[finite] - ref[finite])
    allowed = tol * np.maximum(np.abs(ref[finite]), floor)
    bad = err > allowed
    assert not bad.any(), (f"{name}: {int(bad.sum())} of {bad.size} elements off (worst {err.max():.3g}, "
                           f"allowed {tol} relative to max(|ref|, {floor}))")


def assert_rows_close(got, ref, tol, name):
    """Probabilities (output_qk with qk_output=2): every element written (no NaN), and each (head, token)
    row within ``tol`` of the reference in the contract's measure, ||got - ref|| / ||ref|| (a row of
    zeros: exactly zero). A probability's own relative error is the score's absolute error, so small
    probabilities are not compared relative to themselves."""
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{name}: shape {got.shape}, expected {ref.shape}"
    assert not np.isnan(got).any(), f"{name}: {int(np.isnan(got).sum())} unwritten (NaN-poisoned) or NaN elements"
    g, r = got.reshape(-1, got.shape[-1]), ref.reshape(-1, ref.shape[-1])
    norm = np.linalg.norm(r, axis=1)
    err = np.linalg.norm(g - r, axis=1)
    zero = norm == 0
    assert not err[zero].any(), f"{name}: {int((err[zero] > 0).sum())} rows that must be zero are not"
    rel = err[~zero] / norm[~zero]
    assert not (rel >= tol).any(), (f"{name}: {int((rel >= tol).sum())} of {rel.size} rows off (worst relative "
                                    f"error {rel.max():.3g} >= {tol})")


def check_outputs_against_reference(cp, inputs, attrs, *, metadata=None, dtype="float16", cache="T", stream=None):
    """check_against_reference for every output of a call: output (NaN-poisoned ``out=``, relative error),
    output_qk and lse element by element (:func:`assert_elementwise`: scores and lse relative to
    max(|ref|, 1); probabilities row by row, :func:`assert_rows_close`), each allocation of the call
    poisoned (:func:`poisoned_allocations`),
    and the caches (LATENT: one). Returns ``(result, device inputs)``."""
    ref_in = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
    ref = split_outputs(cupa.paged_attention(**ref_in, attention_metadata=metadata, **host_attrs(attrs)), attrs)
    dev = to_device(cp, inputs)
    out = cp.full(ref[0].shape, np.nan, dtype=dev["query"].dtype)
    with poisoned_allocations(cp):
        result = cupa.paged_attention(**dev, attention_metadata=metadata, out=out, stream=stream, **attrs)
    cp.cuda.get_current_stream().synchronize()
    if stream is not None:
        stream.synchronize()
    got = split_outputs(result, attrs)
    assert got[0] is out or got[0].data.ptr == out.data.ptr
    host = cp.asnumpy(out)
    assert not np.isnan(host.astype(np.float32)).any(), "output has unwritten (NaN-poisoned) elements"
    err = rel_error(host, ref[0])
    assert err < TOLERANCE[dtype], f"relative error {err:.3g} >= {TOLERANCE[dtype]}"
    if got[1] is not None:
        if attrs["qk_output"] == 2:
            assert_rows_close(cp.asnumpy(got[1]), ref[1], TOLERANCE[dtype], "output_qk")
        else:
            assert_elementwise(cp.asnumpy(got[1]), ref[1], TOLERANCE[dtype], "output_qk")
    if got[2] is not None:
        assert_elementwise(cp.asnumpy(got[2]), ref[2], TOLERANCE[dtype], "lse")
    for name in ("key_cache", "value_cache"):
        if name in inputs:
            assert_cache_close(cp.asnumpy(dev[name]), ref_in[name], cache, dtype, name)
    return result, dev
