"""The test kit: one random paged-problem builder, an independent dense attention, the comparisons.

* :func:`make_case` builds a random paged PagedAttention call (:class:`Case`): fresh random data
  from the given ``np.random.Generator`` (never zeros), shuffled block tables (:func:`paged_layout`),
  ragged query lengths (zero-token sequences allowed), garbage in every unused cache block, and options
  for every feature of contract §1-§4. :func:`build` and :func:`build_latent` are the GPU suites' view of
  the same builder: their parameter names and defaults (decode-shaped, spare blocks, -1 in unused
  block-table entries), NumPy ``(inputs, attrs)`` with the absent inputs left out, the module's
  :data:`OPTIONS` in attrs. :func:`poison_unused_cache_rows` puts NaN in every cache row no sequence reads.
* :func:`dense_attention` is a plain per-token float64 implementation of the contract written
  independently of ``cupa/reference.py`` (loops, small sizes only). It returns the expected output,
  output_qk, lse and the caches after the call, and which cache slots each token wrote and admitted.
* :func:`rel_err`, :func:`assert_rel`, :func:`assert_within_ulp`, :func:`assert_cache_close`,
  :func:`assert_matches_reference` compare results with the tolerances of contract §6
  (``cupa.contract.TOLERANCE``); :func:`check_against_reference` and
  :func:`check_outputs_against_reference` run the reference and a CUDA backend (``cp``: CuPy) on the
  same inputs and compare every output element and cache byte.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import ml_dtypes
import numpy as np

import cupa
from cupa.contract import INPUT_NAMES

T_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
            "float32": np.dtype(np.float32)}
F8 = np.dtype(ml_dtypes.float8_e4m3fn)
#: contract §6: ||out - ref|| / ||ref|| for CUDA backends against the reference (the one tolerance table)
from cupa.contract import TOLERANCE  # noqa: E402
#: mantissa bits and minimum normal exponent of each T (for ulp bounds)
_MANT = {"float16": (10, -14), "bfloat16": (7, -126), "float32": (23, -126)}
#: cache kinds accepted by make_case ("int4" / "fp4": packed two codes a byte in uint8 caches)
CACHE_KINDS = ("T", "int8", "fp8", "fp8_bytes", "int4", "fp4")
#: k/v_cache_dtype of the kinds held in uint8 arrays
BYTE_KINDS = {"fp8_bytes": "float8e4m3fn", "int4": "int4", "fp4": "float4e2m1"}
#: the largest code of each quantized kind (what make_case sizes its scales by)
QMAX = {"int8": 127, "fp8": 448, "fp8_bytes": 448, "int4": 7, "fp4": 6}


# ------------------------------------------------------------------------------------------------
# problem builder

@dataclass
class Case:
    """One PagedAttention call: ``inputs`` (every name of INPUT_NAMES, None when absent) + ``attrs``."""

    inputs: dict
    attrs: dict
    q_lens: np.ndarray = None
    past: np.ndarray = None
    info: dict = field(default_factory=dict)

    @property
    def dtype(self) -> str:
        return np.dtype(self.inputs["query"].dtype).name

    @property
    def token_count(self) -> int:
        return int(self.inputs["query"].shape[0])

    def present_inputs(self) -> dict:
        """``inputs`` without the absent (None) ones."""
        return {n: v for n, v in self.inputs.items() if v is not None}

    def kwargs(self) -> dict:
        kw = self.present_inputs()
        kw.update(self.attrs)
        return kw

    def copy(self) -> "Case":
        return Case({n: (None if v is None else np.array(v, copy=True)) for n, v in self.inputs.items()},
                    dict(self.attrs), None if self.q_lens is None else self.q_lens.copy(),
                    None if self.past is None else self.past.copy(), copy.deepcopy(self.info))

    def run(self, **extra):
        """Run cupa.paged_attention on these inputs (the caches of this case are updated)."""
        kw = self.kwargs()
        kw.update(extra)
        return cupa.paged_attention(**kw)


def random_lengths(rng, batch, max_q=6, max_past=40, zero_q=0.25):
    """Ragged (q_lens, past) with some zero-token sequences."""
    q = rng.integers(1, max_q + 1, size=batch)
    q[rng.random(batch) < zero_q] = 0
    past = rng.integers(0, max_past + 1, size=batch)
    return q.astype(np.int64), past.astype(np.int64)


def _rand_T(rng, shape, T, scale=1.0):
    x = rng.standard_normal(shape) * scale
    x[x == 0] = 0.5  # never zeros
    return x.astype(T)


def _random_cache(rng, shape, kind, T, qmax):
    """Garbage-filled cache of the requested kind (random values, never all zero; packed kinds: random
    bytes, last dimension halved, every nibble a valid code)."""
    if kind == "T":
        return _rand_T(rng, shape, T)
    if kind in ("int4", "fp4"):
        return rng.integers(1, 256, size=shape[:-1] + (shape[-1] // 2,)).astype(np.uint8)
    if kind == "int8":
        c = rng.integers(-qmax, qmax + 1, size=shape).astype(np.int8)
        c[c == 0] = 1
        return c
    vals = np.clip(rng.standard_normal(shape) * (qmax / 3.0), -448, 448).astype(np.float32)
    codes = vals.astype(F8)
    return codes.view(np.uint8).copy() if kind == "fp8_bytes" else codes


def paged_layout(rng, q_lens, past, block_size, *, extra_blocks=3, extra_cols=1, max_blocks=None, shuffle=True,
                 unused_cols="garbage", block_table=None):
    """cumulative_sequence_length, block_table and the number of physical blocks of a paged problem.

    Each sequence gets ceil(kv_len / block_size) blocks (at least one) of a pool with ``extra_blocks``
    spare ones, physical ids shuffled (``shuffle``). The table has ``max_blocks`` columns (default: the
    most blocks a sequence needs + ``extra_cols``); its unused entries hold -1 (``unused_cols="neg"``)
    or random block ids (``"garbage"``). ``block_table``: None, "shared" (sequence 1 maps its first
    block to sequence 0's: a shared prefix) or "unmapped" (evicted -1 entries and an out-of-range id
    inside the sequences' keys, both masked on read). Returns ``(cum, block_table, num_blocks)``.
    """
    q_lens, past = np.asarray(q_lens, dtype=np.int64), np.asarray(past, dtype=np.int64)
    B = q_lens.size
    kv_len = past + q_lens
    cum = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    need = [max(1, -(-int(L) // block_size)) for L in kv_len]
    MB = max_blocks or max(need) + extra_cols
    NB = sum(need) + extra_blocks
    phys = rng.permutation(NB) if shuffle else np.arange(NB)
    bt = np.full((B, MB), -1, dtype=np.int32)
    used = 0
    for b in range(B):
        bt[b, :need[b]] = phys[used:used + need[b]]
        used += need[b]
        if unused_cols == "garbage":
            bt[b, need[b]:] = rng.integers(0, NB, size=MB - need[b])
    if block_table not in (None, "shared", "unmapped"):
        raise ValueError(f"block_table: got {block_table!r}; expected None, 'shared' or 'unmapped'")
    if block_table == "shared" and B > 1 and need[0] > 1 and need[1] > 1:
        bt[1, 0] = bt[0, 0]
    if block_table == "unmapped":
        for b in range(B):
            if need[b] > 2:
                bt[b, 0] = -1
        bt[0, min(1, MB - 1)] = NB + 7 if need[0] > 1 else bt[0, 0]
    return cum, bt, NB


def make_case(rng, *, num_heads=4, kv_num_heads=2, head_size=64, block_size=16,
              q_lens=(3, 0, 5, 1), past=(7, 4, 0, 18), dtype="float16",
              cache="T", k_quant="PER_TENSOR", v_quant="PER_TENSOR",
              packed=False, rotary=None, rotary_dim=None, rotary_offset=0, max_position=None, rope_base=None,
              positions=None, qk_norm=False, window=-1, softcap=0.0, sink=False, is_causal=1,
              scale=0.0, bias=None, bias_pad=(0, 0), bias_neg_inf=0.0, qk_output=0, return_lse=False,
              slot_mapping=None, max_blocks=None, block_table=None,
              metadata=None, shuffle=True, extra_blocks=3, extra_cols=1, unused_cols="garbage",
              latent=False, v_head_size=0, value_scale=1.0, v_cache=None):
    """Build a random paged call.

    Parameters (all keyword)
    ------------------------
    q_lens, past : per-sequence new-token counts and cached lengths (ragged; zeros allowed).
    dtype : T ("float16", "bfloat16", "float32").
    cache : "T", "int8", "fp8" (ml_dtypes float8_e4m3fn arrays), "fp8_bytes" (uint8 + k/v_cache_dtype), or
        "int4" / "fp4" (packed two codes a byte in uint8 arrays of last dimension head_size / 2).
    v_cache : value_cache's kind when it differs from ``cache`` (both of the uint8 kinds: "fp8_bytes",
        "int4", "fp4").
    k_quant, v_quant : "PER_TENSOR" or "PER_CHANNEL" (quantized caches only).
    packed : packed QKV in ``query``.
    rotary : None, "half" or "interleaved"; rotary_dim (default head_size - rotary_offset); rotary_offset;
        max_position (cos/sin rows; default max(kv_len, largest position + 1) + 5); rope_base (default
        100 or 10000 at random).
    positions : None (default positions), "explicit" (query_positions equal to the default),
        "random" (random positions in [0, kv_len_b)), or an int array of length N.
    qk_norm, window, softcap, sink, is_causal, scale, qk_output, return_lse : the features of contract §3.
    bias : None or (batch_broadcast, head_broadcast); bias_pad adds (q, kv) capacity beyond the maxima
        (negative values make an undersized bias whose out-of-capacity entries are masked); bias_neg_inf:
        the fraction of its entries set to -inf, and then also all of entry (0, 0, 0, :) (the first query
        row of sequence 0, head 0 admits no finite key).
    slot_mapping : None, "derived" (explicit and equal to the derived slots), "skip" (derived with
        some -1 entries) or the slots themselves.
    metadata : None, "tight", "loose" or a tuple.
    shuffle, extra_blocks, extra_cols, max_blocks, unused_cols, block_table : the paging
        (:func:`paged_layout`).
    latent, v_head_size : LATENT (MLA) layout: key is (N, head_size), one cache, kv_num_heads 1.
    """
    T = T_DTYPES[dtype]
    H, Hk, D, bs = num_heads, kv_num_heads, head_size, block_size
    if latent:
        Hk = 1
    q_lens = np.asarray(q_lens, dtype=np.int64)
    past = np.asarray(past, dtype=np.int64)
    B = q_lens.size
    N = int(q_lens.sum())
    kv_len = past + q_lens
    cum, bt, NB = paged_layout(rng, q_lens, past, bs, extra_blocks=extra_blocks, extra_cols=extra_cols,
                               max_blocks=max_blocks, shuffle=shuffle, unused_cols=unused_cols,
                               block_table=block_table)
    MB = bt.shape[1]

    quant = cache != "T"
    v_cache = cache if v_cache is None or latent else v_cache
    cache_shape = (NB, bs, Hk, D)
    key_cache = _random_cache(rng, cache_shape, cache, T, QMAX.get(cache))
    value_cache = None if latent else _random_cache(rng, cache_shape, v_cache, T, QMAX.get(v_cache))

    attrs = dict(num_heads=H, kv_num_heads=Hk)
    inputs = dict.fromkeys(INPUT_NAMES)
    q = _rand_T(rng, (N, H * D), T)
    k = _rand_T(rng, (N, D) if latent else (N, Hk * D), T)
    v = None if latent else _rand_T(rng, (N, Hk * D), T, value_scale)
    if packed:
        inputs["query"] = np.ascontiguousarray(np.concatenate([q, k, v], axis=1))
    else:
        inputs["query"], inputs["key"], inputs["value"] = q, k, v
    inputs.update(key_cache=key_cache, value_cache=value_cache, cumulative_sequence_length=cum,
                  past_seqlens=past.astype(np.int32), block_table=bt)

    # positions
    default_pos = np.concatenate([past[b] + np.arange(q_lens[b]) for b in range(B)]).astype(np.int64) \
        if N else np.zeros(0, dtype=np.int64)
    if positions is None:
        pos = default_pos
    elif isinstance(positions, str) and positions == "explicit":
        pos = default_pos
        inputs["query_positions"] = pos.astype(np.int32)
    elif isinstance(positions, str) and positions == "random":
        owner = np.repeat(np.arange(B), q_lens)
        pos = np.array([rng.integers(0, max(1, kv_len[b])) for b in owner], dtype=np.int64)
        inputs["query_positions"] = pos.astype(np.int32)
    else:
        pos = np.asarray(positions, dtype=np.int64)
        inputs["query_positions"] = pos.astype(np.int32)

    if rotary is not None:
        rd = rotary_dim if rotary_dim is not None else D - rotary_offset
        mp = max_position if max_position is not None else int(max(kv_len.max(), pos.max() + 1 if N else 1)) + 5
        base = rope_base if rope_base is not None else float(rng.choice([100.0, 10000.0]))
        cos, sin = cupa.rope_cache(mp, rd, base=base, dtype=T)
        inputs["cos_cache"], inputs["sin_cache"] = cos, sin
        attrs.update(do_rotary=1, rotary_interleaved=int(rotary == "interleaved"), rotary_offset=rotary_offset)
    if qk_norm:
        inputs["q_norm_weight"] = rng.uniform(0.5, 1.5, D).astype(T)
        inputs["k_norm_weight"] = rng.uniform(0.5, 1.5, D).astype(T)
        attrs["qk_norm_epsilon"] = float(rng.choice([1e-6, 1e-3]))
    if sink:
        inputs["head_sink"] = (rng.standard_normal(H) * 2.0).astype(T)
    if quant:
        def mkscale(qt, mag, kind):
            base = 3.0 * mag / QMAX[kind]
            if qt == "PER_TENSOR":
                return np.array([base * rng.uniform(0.8, 1.2)], dtype=np.float32)
            return (base * rng.uniform(0.5, 1.5, (Hk, 1, D))).astype(np.float32)
        inputs["k_scale"] = mkscale(k_quant, 1.0, cache)
        attrs["k_quant_type"] = k_quant
        if not latent:
            inputs["v_scale"] = mkscale(v_quant, value_scale, v_cache)
            attrs["v_quant_type"] = v_quant
        if cache in BYTE_KINDS:
            attrs["k_cache_dtype"] = BYTE_KINDS[cache]
            if not latent:
                attrs["v_cache_dtype"] = BYTE_KINDS[v_cache]
    if bias is not None:
        bb, hb = bias
        qcap = int(max(1, q_lens.max() + bias_pad[0]))
        kcap = int(max(1, kv_len.max() + bias_pad[1]))
        shape = (1 if bb else B, 1 if hb else H, qcap, kcap)
        values = _rand_T(rng, shape, T, 2.0)
        if bias_neg_inf:
            values[rng.random(shape) < bias_neg_inf] = -np.inf
            values[0, 0, 0, :] = -np.inf
        inputs["attention_bias"] = values
    if isinstance(slot_mapping, str):
        slots = derived_slots(inputs, bs, positions=pos)
        if slot_mapping == "skip" and N:
            slots[rng.random(N) < 0.3] = -1
        inputs["slot_mapping"] = slots.astype(np.int32)
    elif slot_mapping is not None:
        inputs["slot_mapping"] = np.asarray(slot_mapping, dtype=np.int32)
    if metadata is not None:
        if metadata == "tight":
            md = (int(max(1, q_lens.max())), int(max(1, kv_len.max())))
        elif metadata == "loose":
            md = (int(q_lens.max()) * 3 + 7, MB * bs * 4 + 5, 1)
        else:
            md = tuple(metadata)
        inputs["attention_metadata"] = np.array(md, dtype=np.int32)
    for name, val in (("local_window_size", window), ("softcap", softcap), ("is_causal", is_causal),
                      ("scale", scale), ("qk_output", qk_output), ("return_lse", return_lse)):
        if val != dict(local_window_size=-1, softcap=0.0, is_causal=1, scale=0.0, qk_output=0, return_lse=False)[name]:
            attrs[name] = val
    if latent:
        attrs["kv_cache_layout"] = "LATENT"
        if v_head_size:
            attrs["v_head_size"] = v_head_size
    return Case(inputs, attrs, q_lens, past, dict(positions=pos, cache=cache, v_cache=v_cache, block_size=bs))


def prefill_case(rng, batch=2, q_len=12, past=0, **kw):
    """A prefill-shaped case: ``batch`` sequences of ``q_len`` new tokens after ``past`` cached ones."""
    return make_case(rng, q_lens=(q_len,) * batch, past=(past,) * batch, **kw)


def decode_case(rng, batch=4, context=(10, 40), **kw):
    """A decode-shaped case: one new token per sequence, random cached lengths in ``context``."""
    past = rng.integers(context[0], context[1] + 1, size=batch)
    return make_case(rng, q_lens=(1,) * batch, past=past, **kw)


def derived_slots(inputs, block_size, *, positions=None):
    """The slots the operator derives for the tokens of ``inputs`` (its block_table,
    cumulative_sequence_length, past_seqlens and query_positions; ``positions`` overrides the positions),
    int64, -1 where unmapped or beyond the row."""
    block_table, cum = inputs["block_table"], np.asarray(inputs["cumulative_sequence_length"])
    q_lens = np.diff(cum)
    if positions is None:
        positions = inputs.get("query_positions")
    if positions is None:
        positions = np.concatenate([np.zeros(0, np.int64)] + [int(p) + np.arange(q)
                                                              for p, q in zip(inputs["past_seqlens"], q_lens)])
    owner = np.repeat(np.arange(len(q_lens)), q_lens)
    out = np.full(len(positions), -1, dtype=np.int64)
    for t, (b, p) in enumerate(zip(owner, positions)):
        lb = p // block_size
        if p >= 0 and lb < block_table.shape[1] and block_table[b, lb] >= 0:
            out[t] = int(block_table[b, lb]) * block_size + p % block_size
    return out


# ------------------------------------------------------------------------------------------------
# the GPU suites' view of the builder

#: The cupa.Options every case of :func:`build` runs with (its attrs carry them); a test module's fixture
#: sets it (monkeypatch) to run its cases with another backend or launch route.
OPTIONS = None
#: Absorbed MLA (LATENT): kv_lora_rank + qk_rope_head_dim latent channels, V = the first kv_lora_rank.
MLA_D, MLA_DV, MLA_ROPE = 576, 512, 64
#: DeepSeek's softmax scale before YaRN: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) = 1/sqrt(192) (seed 12.6).
MLA_SCALE = 1.0 / math.sqrt(192.0)


def build(rng, *, B=4, H=8, Hk=2, D=64, block_size=16, dtype="float16", q_lens=None, past=None,
          max_blocks=None, cache="T", k_quant="PER_CHANNEL", v_quant="PER_CHANNEL", packed=False,
          rotary=False, interleaved=False, rotary_dim=None, rotary_offset=0, qk_norm=False, sink=False,
          softcap=0.0, window=-1, is_causal=1, slot_mapping=None, query_positions=False, block_table="shuffled",
          spare_blocks=3, bias=None, bias_pad=(0, 0), bias_neg_inf=0.0, qk_output=0, return_lse=False,
          latent=False, v_head_size=0, scale=0.0, v_cache=None):
    """NumPy ``(inputs, attrs)`` of a random paged problem (:func:`make_case`), decode-shaped by default.

    ``q_lens`` default one new token for each of ``B`` sequences, ``past`` random in [1, 200). ``cache``:
    "T", "int8", "fp8" (e4m3 codes as uint8 bytes, k/v_cache_dtype set) or the packed 4-bit "int4" / "fp4"
    (uint8 caches of last dimension D / 2); ``v_cache``: value_cache's kind where it differs (the other
    4-bit kind); scales PER_CHANNEL by default.
    ``rotary`` (RoPE on ``rotary_dim`` channels, default D, from ``rotary_offset``; ``interleaved``
    pairs), cos/sin rows up to the longest sequence + 8, base 10000. ``query_positions``: explicit, equal
    to the default positions. ``slot_mapping``: explicit slots. ``block_table``: "shuffled", "shared" or
    "unmapped" (:func:`paged_layout`); ``spare_blocks`` spare physical blocks; unused table entries -1,
    ``max_blocks`` columns (default the most a sequence needs + 2). ``bias``, ``bias_pad``,
    ``bias_neg_inf``: as in make_case. ``latent``: the LATENT layout (kv_num_heads 1, one cache,
    ``v_head_size`` channels of V; give ``scale`` when v_head_size != D). ``inputs`` leaves the absent
    inputs out; ``attrs`` always carries softcap, local_window_size and is_causal, and :data:`OPTIONS`.
    """
    q_lens = list(q_lens) if q_lens is not None else [1] * B
    past = list(past) if past is not None else [int(x) for x in rng.integers(1, 200, size=len(q_lens))]
    case = make_case(
        rng, num_heads=H, kv_num_heads=Hk, head_size=D, block_size=block_size, q_lens=q_lens, past=past,
        dtype=dtype, cache={"fp8": "fp8_bytes"}.get(cache, cache), k_quant=k_quant, v_quant=v_quant,
        packed=packed and not latent, rotary=("interleaved" if interleaved else "half") if rotary else None,
        rotary_dim=rotary_dim or D, rotary_offset=rotary_offset,
        max_position=max(p + q for p, q in zip(past, q_lens)) + 8, rope_base=10000.0,
        positions="explicit" if query_positions else None, qk_norm=qk_norm, window=window, softcap=softcap,
        sink=sink, is_causal=is_causal, scale=scale, bias=bias, bias_pad=bias_pad, bias_neg_inf=bias_neg_inf,
        qk_output=qk_output, return_lse=return_lse, slot_mapping=slot_mapping, extra_blocks=spare_blocks,
        extra_cols=2, max_blocks=max_blocks, unused_cols="neg",
        block_table=None if block_table == "shuffled" else block_table, latent=latent, v_head_size=v_head_size,
        v_cache=None if v_cache is None else {"fp8": "fp8_bytes"}.get(v_cache, v_cache))
    attrs = dict(case.attrs, softcap=softcap, local_window_size=window, is_causal=is_causal)
    if OPTIONS is not None:
        attrs["options"] = OPTIONS
    return case.present_inputs(), attrs


def build_latent(rng, *, B=4, H=16, block_size=64, dtype="float16", q_lens=None, past=None, max_blocks=None,
                 cache="T", k_quant="PER_CHANNEL", rotary=False, interleaved=False, softcap=0.0, window=-1,
                 is_causal=1, slot_mapping=None, query_positions=False, block_table="shuffled", spare_blocks=3,
                 scale=MLA_SCALE, return_lse=False):
    """:func:`build` of a random absorbed-MLA problem (kv_cache_layout LATENT, decode-shaped by default):
    query (N, H*576), key (N, 576) the new latent rows, key_cache (num_blocks, block_size, 1, 576) of T or
    fp8 codes (uint8 bytes, k_scale PER_TENSOR or PER_CHANNEL), v_head_size 512, an explicit scale, and
    with ``rotary`` RoPE on channels 512..575 (rotary_offset 512); attrs always carry return_lse."""
    inputs, attrs = build(rng, B=B, H=H, Hk=1, D=MLA_D, block_size=block_size, dtype=dtype, q_lens=q_lens,
                          past=past, max_blocks=max_blocks, cache=cache, k_quant=k_quant, rotary=rotary,
                          interleaved=interleaved, rotary_dim=MLA_ROPE, rotary_offset=MLA_DV, softcap=softcap,
                          window=window, is_causal=is_causal, slot_mapping=slot_mapping,
                          query_positions=query_positions, block_table=block_table, spare_blocks=spare_blocks,
                          latent=True, v_head_size=MLA_DV, scale=scale, return_lse=return_lse)
    attrs["return_lse"] = return_lse
    return inputs, attrs


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


#: Variants of a backend the GPU isolation tests run beside it: name -> cupa.Options keyword arguments
BACKEND_VARIANTS = {
    # the wgmma prefill with its V tiles cleaned by the copier warps (Options._tuning.prefill_ws_copier_clean)
    "prefill_wgmma[copier_clean]": dict(backend="prefill_wgmma", _tuning={"prefill_ws_copier_clean": True}),
}


def backend_options(name: str):
    """The cupa.Options that run backend ``name`` (or one of :data:`BACKEND_VARIANTS`)."""
    from cupa.options import _Tuning

    kw = dict(BACKEND_VARIANTS.get(name, {"backend": name}))
    if "_tuning" in kw:
        kw["_tuning"] = _Tuning(**kw["_tuning"])
    return cupa.Options(**kw)


def device_capability():
    """The compute capability of device 0, or None without CuPy, a driver or a device."""
    try:
        from cupa.device import device_info

        return device_info(0).capability
    except Exception:  # no cupy, no driver, no device
        return None


def to_device(cp, inputs):
    """``inputs`` with every array moved by ``cp.asarray`` (metadata and None stay)."""
    return {k: (cp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}


def host_attrs(attrs: dict) -> dict:
    """``attrs`` for the NumPy reference: without the Options of a CUDA backend."""
    return {k: v for k, v in attrs.items() if k != "options"}


def with_options(attrs: dict, **changes) -> dict:
    """``attrs`` whose Options (``cupa.Options()`` if none) have ``changes`` applied."""
    return dict(attrs, options=dataclasses.replace(attrs.get("options") or cupa.Options(), **changes))


# ------------------------------------------------------------------------------------------------
# independent brute-force dense attention

@dataclass
class DenseResult:
    output: np.ndarray             # (N, H*Dv) float64 (not rounded to T)
    output_qk: Optional[np.ndarray]  # (H, N, kv_capacity) float64 or None
    key_cache: np.ndarray          # expected caches after the call
    value_cache: Optional[np.ndarray]
    written: np.ndarray            # (N,) bool: the token wrote its K/V
    valid: np.ndarray              # (N,) bool: the token belongs to a valid sequence and is itself valid
    lse: np.ndarray = None         # (N, H) float64: log of sum(exp(score)) over admitted keys, sink left out
    slot: np.ndarray = None        # (N,) int64: the flat cache slot the token wrote, -1 if none
    admitted: list = None          # per token, the set of flat cache slots of the keys it admits


def _quantize_plain(x_T, scale, kind):
    """Plain restatement of the write rule: saturate(rne(float32(x) * float32(1/scale))); int4 and
    e2m1 codes packed two a byte (int4 nibble q + 8; NaN saturates to -8, and to +6 in e2m1)."""
    inv = np.float32(1.0) / np.asarray(scale, dtype=np.float32)
    y = np.asarray(x_T).astype(np.float32) * inv
    y = y.astype(np.float32)
    if kind == "int8":
        return np.clip(np.round(y), -128, 127).astype(np.int8)
    if kind == "int4":
        nibbles = np.where(np.isnan(y), 0, np.clip(np.round(y), -8, 7) + 8).astype(np.uint8)
    elif kind == "fp4":
        codes = np.where(np.isnan(y), np.float32(6), np.clip(y, -6.0, 6.0)).astype(np.float32)
        nibbles = codes.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 15
    else:
        return np.clip(y, -448.0, 448.0).astype(np.float32).astype(F8)
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)


def unpack_plain(row, kind):
    """float64 code values of a packed row (..., n) of ``kind`` ("int4" / "fp4"): (..., 2n), code 2i from
    the low nibble of byte i."""
    row = np.asarray(row)
    nibbles = np.stack([row & 15, row >> 4], axis=-1).reshape(row.shape[:-1] + (2 * row.shape[-1],))
    if kind == "int4":
        return nibbles.astype(np.float64) - 8.0
    return nibbles.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def dense_attention(case: Case) -> DenseResult:
    """Brute-force float64 PagedAttention, one token (and one head) at a time."""
    inp, at = case.inputs, case.attrs
    get = lambda n, d: at.get(n, d)
    H, Hk = get("num_heads", None), get("kv_num_heads", None)
    latent = get("kv_cache_layout", "SEPARATE") == "LATENT"
    query = inp["query"]
    T = query.dtype
    N = query.shape[0]
    packed = inp["key"] is None and not latent
    D = query.shape[1] // (H + 2 * Hk) if packed else query.shape[1] // H
    Dv = (get("v_head_size", 0) or D) if latent else D
    G = H // Hk
    kc = inp["key_cache"].copy()
    vc = None if latent else inp["value_cache"].copy()
    NB, bs = kc.shape[0], kc.shape[1]
    cum = [int(c) for c in inp["cumulative_sequence_length"]]
    past = [int(c) for c in inp["past_seqlens"]]
    bt = inp["block_table"]
    B = len(cum) - 1
    MB = bt.shape[1]
    scale = get("scale", 0.0) or 1.0 / math.sqrt(D)
    softcap = get("softcap", 0.0)
    W = get("local_window_size", -1)
    causal = get("is_causal", 1) == 1
    rotary = get("do_rotary", 0) == 1
    inter = get("rotary_interleaved", 0) == 1
    roff = get("rotary_offset", 0)
    eps = get("qk_norm_epsilon", 1e-6)
    qk_mode = get("qk_output", 0)
    if kc.dtype == T:
        k_kind = "T"
    elif kc.dtype == np.int8:
        k_kind = "int8"
    elif kc.dtype == np.uint8:
        k_kind = {"float8e4m3fn": "fp8", "int4": "int4", "float4e2m1": "fp4"}[get("k_cache_dtype", "")]
    else:
        k_kind = "fp8"
    v_kind = k_kind if latent else ({"float8e4m3fn": "fp8", "int4": "int4", "float4e2m1": "fp4"}[
        get("v_cache_dtype", "")] if kc.dtype == np.uint8 else k_kind)
    as_bytes = kc.dtype == np.uint8
    md = inp["attention_metadata"]
    kvcap = MB * bs
    if md is not None and int(md[1]) != 0:
        kvcap = min(int(md[1]), MB * bs)

    def f64(a):
        return np.asarray(a).astype(np.float64)

    def to_T(a):
        return np.asarray(a, dtype=np.float64).astype(T)

    def scale_for(name, kvh, width):
        s = inp[name]
        if s.shape == (1,):
            return np.full(width, float(s[0]))
        return f64(s[kvh, 0, :width])

    def encode(x_T, name, kvh, kind):
        if kind == "T":
            return x_T
        s = np.asarray(inp[name], dtype=np.float32)
        s = s if s.shape == (1,) else s[kvh, 0, :]
        codes = _quantize_plain(x_T, s, kind)
        return codes.view(np.uint8) if as_bytes else codes

    def decode(row, name, kvh, width, kind):
        if kind == "T":
            return f64(row[:width])
        if kind in ("int4", "fp4"):
            return unpack_plain(row, kind)[:width] * scale_for(name, kvh, width)
        row = row[:width]
        if as_bytes:
            row = row.view(F8)
        return f64(row) * scale_for(name, kvh, width)

    def rope(vec, p):
        out = vec.copy()
        half = inp["cos_cache"].shape[1]
        for i in range(half):
            c = float(inp["cos_cache"][p, i])
            s = float(inp["sin_cache"][p, i])
            if inter:
                i1, i2 = roff + 2 * i, roff + 2 * i + 1
            else:
                i1, i2 = roff + i, roff + i + half
            out[i1] = vec[i1] * c - vec[i2] * s
            out[i2] = vec[i2] * c + vec[i1] * s
        return out

    def rms(vec, w):
        return vec / math.sqrt(float(np.sum(vec * vec)) / D + eps) * f64(w)

    # --- per-token prologue ---
    toks = []
    for t in range(N):
        lo, hi = 0, B
        while lo < hi:
            mid = (lo + hi) // 2
            if cum[mid + 1] > t:
                hi = mid
            else:
                lo = mid + 1
        b = lo
        info = dict(valid=False, b=b)
        toks.append(info)
        if not (b < B and cum[b] <= t):
            continue
        ql = cum[b + 1] - cum[b]
        if past[b] < 0 or ql < 0 or past[b] + ql > MB * bs:
            continue
        j = t - cum[b]
        p = int(inp["query_positions"][t]) if inp["query_positions"] is not None else past[b] + j
        if p < 0 or (rotary and p >= inp["cos_cache"].shape[0]):
            continue
        row = f64(query[t])
        if packed:
            qrow = row[:H * D]
            krow = row[H * D:(H + Hk) * D]
            vrow = query[t, (H + Hk) * D:]
        else:
            qrow = row
            krow = f64(inp["key"][t])
            vrow = None if latent else inp["value"][t]
        qh, kh = [], []
        for h in range(H):
            x = qrow[h * D:(h + 1) * D]
            if inp["q_norm_weight"] is not None:
                x = rms(x, inp["q_norm_weight"])
            if rotary:
                x = rope(x, p)
            qh.append(f64(to_T(x)))
        for h in range(Hk):
            x = krow[h * D:(h + 1) * D]
            if inp["k_norm_weight"] is not None:
                x = rms(x, inp["k_norm_weight"])
            if rotary:
                x = rope(x, p)
            kh.append(to_T(x))
        vh = None if latent else [np.asarray(vrow[h * D:(h + 1) * D]).astype(T) for h in range(Hk)]
        info.update(valid=True, j=j, p=p, q=qh, k=kh, v=vh, kv_len=past[b] + ql)

    # --- writes (all before any read) ---
    written = np.zeros(N, dtype=bool)
    slot_of = np.full(N, -1, dtype=np.int64)
    for t, info in enumerate(toks):
        if not info["valid"]:
            continue
        if inp["slot_mapping"] is not None:
            slot = int(inp["slot_mapping"][t])
            if not (0 <= slot < NB * bs):
                continue
        else:
            lb = info["p"] // bs
            if lb >= MB:
                continue
            blk = int(bt[info["b"], lb])
            if not (0 <= blk < NB):
                continue
            slot = blk * bs + info["p"] % bs
        written[t] = True
        slot_of[t] = slot
        for h in range(Hk):
            kc[slot // bs, slot % bs, h] = encode(info["k"][h], "k_scale", h, k_kind)
            if not latent:
                vc[slot // bs, slot % bs, h] = encode(info["v"][h], "v_scale", h, v_kind)

    # --- reads ---
    out = np.zeros((N, H, Dv))
    qk = np.zeros((H, N, kvcap)) if qk_mode else None
    lse = np.full((N, H), -np.inf)
    admitted = [set() for _ in range(N)]
    bias = inp["attention_bias"]
    sink = inp["head_sink"]
    for t, info in enumerate(toks):
        if not info["valid"]:
            continue
        b, p, j = info["b"], info["p"], info["j"]
        keys, vals, kpos = [], [], []
        for k in range(info["kv_len"]):
            if causal and k > p:
                continue
            if W > 0 and not (p - W < k):
                continue
            blk = int(bt[b, k // bs])
            if not (0 <= blk < NB):
                continue
            if bias is not None and (j >= bias.shape[2] or k >= bias.shape[3]):
                continue
            kpos.append(k)
            admitted[t].add(blk * bs + k % bs)
            keys.append([decode(kc[blk, k % bs, h], "k_scale", h, D, k_kind) for h in range(Hk)])
            if latent:
                vals.append([decode(kc[blk, k % bs, 0], "k_scale", 0, Dv, k_kind)])
            else:
                vals.append([decode(vc[blk, k % bs, h], "v_scale", h, D, v_kind) for h in range(Hk)])
        if not kpos:
            continue
        for h in range(H):
            g = h // G
            s = np.array([scale * float(np.dot(info["q"][h], keys[i][g])) for i in range(len(kpos))])
            if bias is not None:
                bb = 0 if bias.shape[0] == 1 else b
                hb = 0 if bias.shape[1] == 1 else h
                s = s + np.array([float(bias[bb, hb, j, k]) for k in kpos])
            if softcap > 0:
                s = softcap * np.tanh(s / softcap)
            top = s.max()
            lse[t, h] = top + math.log(float(np.sum(np.exp(s - top)))) if np.isfinite(top) else top
            m = s.max()
            if sink is not None:
                m = max(m, float(sink[h]))
            e = np.exp(s - m)
            den = e.sum() + (math.exp(float(sink[h]) - m) if sink is not None else 0.0)
            prob = e / den
            out[t, h] = sum(prob[i] * vals[i][g] for i in range(len(kpos)))
            if qk is not None:
                for i, k in enumerate(kpos):
                    if k < kvcap:
                        qk[h, t, k] = s[i] if qk_mode == 1 else prob[i]
    valid = np.array([i["valid"] for i in toks], dtype=bool)
    return DenseResult(out.reshape(N, H * Dv), qk, kc, vc, written, valid, lse, slot_of, admitted)


# ------------------------------------------------------------------------------------------------
# comparisons

def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (||out|| when ref is all zeros)."""
    o = np.asarray(out).astype(np.float64)
    r = np.asarray(ref).astype(np.float64)
    den = np.linalg.norm(r)
    num = np.linalg.norm(o - r)
    return float(num / den) if den > 0 else float(num)


def assert_rel(out, ref, dtype, factor=1.0, what="output"):
    """contract §6 relative-error bound for T=dtype (times ``factor``)."""
    err = rel_err(out, ref)
    tol = TOLERANCE[np.dtype(dtype).name if not isinstance(dtype, str) else dtype] * factor
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


def ulp(x, dtype) -> np.ndarray:
    """One unit in the last place of T at |x| (float64)."""
    mant, emin = _MANT[dtype if isinstance(dtype, str) else np.dtype(dtype).name]
    a = np.abs(np.asarray(x, dtype=np.float64))
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    e = np.maximum(np.where(a > 0, e, emin), emin)
    return np.exp2(e - mant)


def assert_within_ulp(out, ref, dtype, n=1.0, what="output"):
    """|out - ref| <= n ulp(T) at ref, elementwise (out is T, ref float64)."""
    o = np.asarray(out).astype(np.float64)
    r = np.asarray(ref, dtype=np.float64)
    assert o.shape == r.shape, f"{what}: shape {o.shape} != {r.shape}"
    assert np.all(np.isfinite(o)), f"{what}: non-finite values"
    bad = np.abs(o - r) > n * ulp(r, dtype) + 1e-300
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} elements off by more than {n} ulp; "
                           f"first at {np.argwhere(bad)[0].tolist()}: got {o[bad][0]!r}, expected {r[bad][0]!r}")


def _code_ordinal(c, packed=None):
    """Signed ordinal of cache codes: consecutive representable values differ by 1 (``packed``: "int4" or
    "fp4", the ordinals of the two nibbles of each byte, last dimension doubled)."""
    c = np.asarray(c)
    if packed is not None:
        n = np.stack([c & 15, c >> 4], axis=-1).astype(np.int64).reshape(c.shape[:-1] + (2 * c.shape[-1],))
        return n if packed == "int4" else np.where(n & 8, -(n & 7), n & 7)
    if c.dtype == np.int8:
        return c.astype(np.int64)
    u = c.view(np.uint8).astype(np.int64)
    return np.where(u & 0x80, -(u & 0x7F), u & 0x7F)


def assert_cache_close(actual, expected, steps=0, what="cache", max_frac=1.0, packed=None, fp32_rows=False):
    """Caches equal byte for byte (steps=0), or within ``steps`` ulp/code where they differ.

    ``max_frac`` bounds the fraction of elements allowed to differ at all (rounding-boundary
    coincidences between two float64 implementations are rare, systematic errors are not);
    ``packed`` ("int4" / "fp4"): uint8 caches of 4-bit codes, compared code by code.
    ``fp32_rows`` (a CUDA backend against the reference): contract §4.1 has the GPU prologue compute in
    fp32, and where the two terms of a rotated pair cancel, fp32 cannot land within one ulp of T of the
    float64 result; a T cache value may then also differ by four fp32 roundings of its row's magnitude.
    """
    a, e = np.ascontiguousarray(actual), np.ascontiguousarray(expected)
    assert a.shape == e.shape and a.dtype == e.dtype, f"{what}: {a.shape}/{a.dtype} vs {e.shape}/{e.dtype}"
    if a.size == 0:
        return
    differs = np.any(a.view(np.uint8).reshape(a.shape + (-1,)) != e.view(np.uint8).reshape(e.shape + (-1,)), axis=-1)
    ndiff = int(differs.sum())
    if ndiff == 0:
        return
    first = np.argwhere(differs)[0].tolist()
    assert steps > 0, (f"{what}: {ndiff} of {a.size} elements differ (expected byte-identical); first at {first}: "
                       f"got {a[tuple(first)]!r}, expected {e[tuple(first)]!r}")
    if a.dtype.name in T_DTYPES:
        e64 = e.astype(np.float64)
        diff = np.abs(a.astype(np.float64) - e64)
        allowed = steps * ulp(e64, a.dtype.name)
        if fp32_rows:
            allowed = allowed * 1.0001 + 4.0 * 2.0 ** -24 * np.abs(e64).max(axis=-1, keepdims=True)
        bad = diff > allowed
    else:
        bad = np.abs(_code_ordinal(a, packed) - _code_ordinal(e, packed)) > steps
    assert not bad.any(), f"{what}: {int(bad.sum())} elements differ by more than {steps} ulp/code; first at {first}"
    assert ndiff <= max(1, max_frac * a.size), f"{what}: {ndiff} of {a.size} elements differ (by at most {steps} step)"


def split_result(result, qk_output=0, return_lse=False):
    """(output, output_qk or None, lse or None) from what paged_attention returned."""
    if not isinstance(result, tuple):
        return result, None, None
    out, rest = result[0], list(result[1:])
    qk = rest.pop(0) if qk_output else None
    lse = rest.pop(0) if return_lse else None
    assert not rest, f"{len(result)} outputs for qk_output={qk_output}, return_lse={return_lse}"
    return out, qk, lse


def assert_lse_close(lse, expected, what="lse", tol=1e-6):
    """lse (float32) against a float64 expectation: within ``tol`` (relative and absolute; the default is
    float32 rounding, a CUDA backend's fp32 arithmetic needs about 1e-4), -inf exactly where expected."""
    lse = np.asarray(lse)
    assert lse.dtype == np.float32 and lse.shape == expected.shape, f"{what}: {lse.dtype} {lse.shape}"
    none = np.isneginf(expected)
    assert np.array_equal(np.isneginf(lse), none), f"{what}: -inf where no key is admitted, and only there"
    np.testing.assert_allclose(lse[~none].astype(np.float64), expected[~none], rtol=tol, atol=tol, err_msg=what)


def check_against_dense(case: Case, result, dense: DenseResult, *, caches_after: Case = None,
                        return_lse: bool = False):
    """Compare a reference/backend result (output, plus output_qk and lse as asked) and the caches
    with dense."""
    dt = case.dtype
    out, qk, lse = split_result(result, case.attrs.get("qk_output", 0), return_lse)
    assert out.dtype == T_DTYPES[dt]
    assert_within_ulp(out, dense.output, dt, what="output")
    if dense.output_qk is not None:
        assert qk is not None and qk.dtype == np.float32 and qk.shape == dense.output_qk.shape
        np.testing.assert_allclose(qk.astype(np.float64), dense.output_qk, rtol=2e-6, atol=1e-6)
    if return_lse:
        assert_lse_close(lse, dense.lse)
    src = caches_after if caches_after is not None else case
    # float64 implementations may land on opposite sides of a rounding boundary very rarely
    k_packed = case.info.get("cache") if case.info.get("cache") in ("int4", "fp4") else None
    v_packed = case.info.get("v_cache") if case.info.get("v_cache") in ("int4", "fp4") else None
    assert_cache_close(src.inputs["key_cache"], dense.key_cache, steps=1, max_frac=1e-3, what="key_cache",
                       packed=k_packed)
    if dense.value_cache is not None:
        assert_cache_close(src.inputs["value_cache"], dense.value_cache, steps=1, max_frac=1e-3,
                           what="value_cache", packed=v_packed)


def apply_rope(x, cos_row, sin_row, offset=0, interleaved=False):
    """RoPE on channels [offset, offset + 2*len(cos_row)) of x (..., D) in float64 (returns float64).

    ``cos_row``/``sin_row`` broadcast against x's leading dimensions (e.g. (N, 1, rd/2) for x (N, H, D)).
    The formula is the contract's: out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin with pairs
    (2i, 2i+1) when interleaved, else (i, i + rd/2).
    """
    x = np.asarray(x).astype(np.float64)
    c = np.asarray(cos_row).astype(np.float64)
    s = np.asarray(sin_row).astype(np.float64)
    half = c.shape[-1]
    y = x.copy()
    if interleaved:
        i1 = offset + 2 * np.arange(half)
        i2 = i1 + 1
    else:
        i1 = offset + np.arange(half)
        i2 = i1 + half
    x1, x2 = x[..., i1], x[..., i2]
    y[..., i1] = x1 * c - x2 * s
    y[..., i2] = x2 * c + x1 * s
    return y


#: the array dtypes of each cache kind of :func:`build` and :func:`make_case`
_CACHE_DTYPES = {"T": tuple(T_DTYPES.values()), "int8": (np.dtype(np.int8),), "fp8": (np.dtype(np.uint8), F8),
                 "fp8_bytes": (np.dtype(np.uint8),), "int4": (np.dtype(np.uint8),), "fp4": (np.dtype(np.uint8),)}
#: the packed 4-bit cache kinds (two codes a byte): the prologue encodes in fp32 what the reference
#: encodes in float32, so their written bytes equal the reference's
PACKED_KINDS = ("int4", "fp4")


def assert_matches_reference(out, ref_out, dtype, caches=(), *, cache="T", output_qk=None, ref_qk=None,
                             v_cache=None):
    """A CUDA backend's results (host NumPy copies) against the reference's (contract §6): output written
    everywhere (no NaN: outputs are NaN-poisoned before the call) and within TOLERANCE[T] relative error;
    each ``(name, got, expected)`` of ``caches``, of kind ``cache`` (of build or make_case), within one
    ulp of T (plus fp32 rounding, see :func:`assert_cache_close`) or one code, packed 4-bit caches byte for
    byte (``v_cache``: value_cache's kind where it differs); output_qk within TOLERANCE[T] relative error."""
    out = np.asarray(out)
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype, (out.shape, out.dtype, ref_out.shape)
    assert not np.isnan(out.astype(np.float32)).any(), "output has unwritten (NaN-poisoned) or NaN elements"
    err = rel_err(out, ref_out)
    assert err < TOLERANCE[dtype], f"relative error {err:.3g} >= {TOLERANCE[dtype]}"
    for name, got, expected in caches:
        kind = v_cache or cache if name == "value_cache" else cache
        assert np.asarray(got).dtype in _CACHE_DTYPES[kind], f"{name}: {np.asarray(got).dtype} is no {kind} cache"
        if kind in PACKED_KINDS:
            assert_cache_close(got, expected, steps=0, what=name, packed=kind)
        else:
            assert_cache_close(got, expected, steps=1, what=name, fp32_rows=True)
    if ref_qk is not None:
        assert output_qk is not None and np.asarray(output_qk).shape == ref_qk.shape
        assert_rel(output_qk, ref_qk, dtype, what="output_qk")


def check_against_reference(cp, inputs, attrs, *, metadata=None, dtype="float16", cache="T", stream=None,
                            v_cache=None):
    """Run the reference and a CUDA backend (``cp``: CuPy) on the same inputs, the latter into a
    NaN-poisoned ``out=``; check output and caches (:func:`assert_matches_reference`; ``v_cache``:
    value_cache's kind where it differs from ``cache``). Returns ``(device output, device inputs)``."""
    ref_in = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
    ref = cupa.paged_attention(**ref_in, attention_metadata=metadata, **host_attrs(attrs))
    dev = to_device(cp, inputs)
    out = cp.full(ref.shape, np.nan, dtype=dev["query"].dtype)
    got = cupa.paged_attention(**dev, attention_metadata=metadata, out=out, stream=stream, **attrs)
    assert got is out or got.data.ptr == out.data.ptr
    cp.cuda.get_current_stream().synchronize()
    assert_matches_reference(cp.asnumpy(out), ref, dtype,
                             [(name, cp.asnumpy(dev[name]), ref_in[name]) for name in ("key_cache", "value_cache")],
                             cache=cache, v_cache=v_cache)
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
    assert rel_err(cp.asnumpy(out), ref) < TOLERANCE[np.dtype(inputs["query"].dtype).name]


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


def assert_same_bits_over_bounds(cp, inputs, attrs, bounds) -> None:
    """Run the call (fresh device inputs each time) once per attention_metadata of ``bounds`` (None: absent)
    and assert that every run gives the first run's bits: output, and where ``attrs`` ask for them lse and
    output_qk over the width both have (a bound sets it)."""
    qk_output, return_lse = attrs.get("qk_output", 0), attrs.get("return_lse", False)
    results = []
    for md in bounds:
        out = split_result(cupa.paged_attention(**to_device(cp, inputs), attention_metadata=md, **attrs), qk_output,
                           return_lse)
        results.append([None if x is None else cp.asnumpy(x) for x in out])
    for other in results[1:]:
        assert np.array_equal(results[0][0].view(np.uint8), other[0].view(np.uint8))
        if return_lse:
            assert np.array_equal(results[0][2].view(np.uint32), other[2].view(np.uint32))
        if qk_output:
            w = min(results[0][1].shape[2], other[1].shape[2])
            assert np.array_equal(results[0][1][..., :w].view(np.uint32), other[1][..., :w].view(np.uint32))


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
    zeros: exactly zero). A probability's own relative error is its score's absolute error, so small
    probabilities are not compared relative to themselves."""
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{name}: shape {got.shape}, expected {ref.shape}"
    assert not np.isnan(got).any(), f"{name}: {int(np.isnan(got).sum())} unwritten (NaN-poisoned) or NaN elements"
    g, r = got.reshape(-1, got.shape[-1]), ref.reshape(-1, ref.shape[-1])
    norm, err = np.linalg.norm(r, axis=1), np.linalg.norm(g - r, axis=1)
    zero = norm == 0
    assert not err[zero].any(), f"{name}: {int((err[zero] > 0).sum())} rows that must be zero are not"
    rel = err[~zero] / norm[~zero]
    assert not (rel >= tol).any(), (f"{name}: {int((rel >= tol).sum())} of {rel.size} rows off (worst relative "
                                    f"error {rel.max():.3g} >= {tol})")


CACHE_NAMES = ("key_cache", "value_cache")


def reference_over_written_caches(inputs, attrs, key_cache, value_cache=None, *, metadata=None):
    """The reference's result over the caches as a backend wrote them (host copies), its own cache write
    skipped. A written value may differ from the reference's by one unit or one code (contract §6), which
    can move a score, a probability or an lse by more than their tolerances; the output (compared as a
    whole) and the caches (within one code) are checked on their own."""
    from unittest import mock

    from cupa import reference

    ref_in = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
    ref_in["key_cache"] = key_cache
    if value_cache is not None:  # (the LATENT layout has one cache)
        ref_in["value_cache"] = value_cache
    with mock.patch.object(reference, "_write_cache", lambda *a, **k: None):  # (the new rows are in them)
        return cupa.paged_attention(**ref_in, attention_metadata=metadata, **host_attrs(attrs))


def qk_and_lse_reference(ref, inputs, ref_in, written, attrs, *, metadata=None):
    """``ref`` (the reference's (output, output_qk, lse)) with output_qk and lse taken over the caches as
    written (``written``: host copies of the backend's key and value caches) where these differ from the
    reference's (``ref_in``, the reference's inputs after its call)."""
    if all(np.asarray(w).tobytes() == np.asarray(ref_in[n]).tobytes() for w, n in zip(written, CACHE_NAMES) if n in ref_in):
        return ref
    over = split_result(reference_over_written_caches(inputs, attrs, *written, metadata=metadata),
                        attrs.get("qk_output", 0), attrs.get("return_lse", False))
    return ref[0], over[1], over[2]


def check_outputs_against_reference(cp, inputs, attrs, *, metadata=None, dtype="float16", cache="T", stream=None):
    """check_against_reference for every output of a call: output (NaN-poisoned ``out=``, relative error),
    output_qk and lse (:func:`assert_elementwise`: scores and lse element by element relative to
    max(|ref|, 1); probabilities row by row, :func:`assert_rows_close`; both over the caches as the backend
    wrote them, :func:`qk_and_lse_reference`), each allocation of the call
    poisoned (:func:`poisoned_allocations`), and the caches (LATENT: one). Returns ``(result, device
    inputs)``."""
    qk_output, return_lse = attrs.get("qk_output", 0), attrs.get("return_lse", False)
    ref_in = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
    ref = split_result(cupa.paged_attention(**ref_in, attention_metadata=metadata, **host_attrs(attrs)),
                       qk_output, return_lse)
    dev = to_device(cp, inputs)
    out = cp.full(ref[0].shape, np.nan, dtype=dev["query"].dtype)
    with poisoned_allocations(cp):
        result = cupa.paged_attention(**dev, attention_metadata=metadata, out=out, stream=stream, **attrs)
    cp.cuda.get_current_stream().synchronize()
    if stream is not None:
        stream.synchronize()
    got = split_result(result, qk_output, return_lse)
    assert got[0] is out or got[0].data.ptr == out.data.ptr
    assert_matches_reference(cp.asnumpy(out), ref[0], dtype,
                             [(name, cp.asnumpy(dev[name]), ref_in[name])
                              for name in ("key_cache", "value_cache") if name in inputs], cache=cache)
    if got[1] is not None or got[2] is not None:
        ref = qk_and_lse_reference(ref, inputs, ref_in, tuple(cp.asnumpy(dev[n]) if n in dev else None for n in CACHE_NAMES),
                                   host_attrs(attrs), metadata=metadata)
    if got[1] is not None:
        if qk_output == 2:
            assert_rows_close(cp.asnumpy(got[1]), ref[1], TOLERANCE[dtype], "output_qk")
        else:
            assert_elementwise(cp.asnumpy(got[1]), ref[1], TOLERANCE[dtype], "output_qk")
    if got[2] is not None:
        assert_elementwise(cp.asnumpy(got[2]), ref[2], TOLERANCE[dtype], "lse")
    return result, dev


# ------------------------------------------------------------------------------------------------
# key shards: block tables that map disjoint key ranges

def shard_block_tables(rng, block_table, num_shards, how="ranges"):
    """``num_shards`` block tables that together map exactly the entries of ``block_table``, each entry in
    one table (the others hold -1 there): the keys of every sequence split into disjoint shards.

    ``how="ranges"`` cuts each row at random block boundaries into consecutive ranges (some empty);
    ``"scatter"`` gives each entry to a random shard. With block_size 1 a cut can fall at any position.
    """
    bt = np.asarray(block_table)
    B, MB = bt.shape
    tables = [np.full_like(bt, -1) for _ in range(num_shards)]
    for b in range(B):
        if how == "ranges":
            edges = [0, *np.sort(rng.integers(0, MB + 1, size=num_shards - 1)), MB]
            owner = np.repeat(np.arange(num_shards), np.diff(edges))
        else:
            owner = rng.integers(0, num_shards, size=MB)
        for s in range(num_shards):
            tables[s][b, owner == s] = bt[b, owner == s]
    return tables


def host_program(tmp_dir, source: str, extra_flags=()):
    """``run(mode, data: bytes) -> bytes``: tests/data/``source`` (a host driver of cuda_src headers) compiled
    for the host by nvcc into ``tmp_dir``; the test skips when nvcc is not on PATH."""
    import shutil
    import subprocess
    from pathlib import Path

    import pytest

    repo = Path(__file__).resolve().parents[1]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip(f"nvcc is not on PATH: the host build of tests/data/{source} needs the CUDA toolkit")
    exe = Path(tmp_dir) / Path(source).stem
    proc = subprocess.run([nvcc, "-std=c++17", "-O1", *extra_flags, "-I", str(repo / "cuda_src"), "-o", str(exe),
                           str(repo / "tests" / "data" / source)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    def run(mode: str, data: bytes) -> bytes:
        out = subprocess.run([str(exe), mode], input=data, capture_output=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout

    return run
