"""ONNX Runtime's CPU ``com.microsoft::GroupQueryAttention`` as an oracle for paged attention.

:func:`gqa_oracle` takes the inputs and attributes of one cupa (PagedAttention) call, rewrites them as
one padded GroupQueryAttention call (the recipe of contract §6), runs it on ONNX Runtime's CPU
execution provider and returns what cupa must produce: the output rows, the cache rows the paged write
must hold, and output_qk.

GroupQueryAttention facts this relies on (onnxruntime 1.32, read from
``onnxruntime.capi.onnxruntime_pybind11_state.get_all_operator_schema()`` and checked by probing the CPU
provider with small models):

- Inputs, in order: query, key, value, past_key, past_value, seqlens_k, total_sequence_length,
  cos_cache, sin_cache, position_ids, attention_bias, head_sink, k_scale, v_scale, q_norm_weight,
  k_norm_weight, query_seqlens. Outputs: output, present_key, present_value, output_qk.
  Caches are BNSH: (B, Hk, C, D).
- query_seqlens[b] = Q valid rows of a right-padded chunk of S rows; seqlens_k[b] + 1 = T tokens after
  the step, so P = T - Q were cached before. Row s sits at absolute position P + s (causal mask, window
  and rotary all use it). Q = 0 is an idle entry (still needs T >= 1). Only the Q valid rows are written,
  to present rows [P, T). ``total_sequence_length`` is only an upper bound of T; P + S <= C is required.
  query_seqlens requires causal=1; without it, S > 1 with past context requires batch_size 1.
- local_window_size = W admits the W positions p - W < k <= p (the query's own included), as in the contract.
- Rotary: cos_cache/sin_cache (max_pos, rotary_dim/2) with rotary_dim/2 a multiple of 8 and
  <= head_size/2, and max_pos >= total_sequence_length; channels [0, rotary_dim) rotate, pairs
  (i, i + rotary_dim/2) or (2i, 2i+1) (rotary_interleaved), computed in float32. There is no rotary
  offset: cupa's rotary_offset is emulated by rolling the channels of Q and K (scores are invariant
  under one permutation of Q's and K's channels).
- attention_bias: (B or 1, H or 1, S, total_sequence_length), column = absolute key position; added
  AFTER softcap (the contract adds it before: never combine the two here).
- head_sink (H,) of T adds exp(sink_h - m) to the softmax denominator; smooth_softmax=1 is a zero sink.
- output_qk: (B, H, S, total_sequence_length) of T. qk_output=1: scale*q.k, then softcap, then bias;
  qk_output=2: the probabilities (sink mass excluded). Masked and padding entries read 0.
- Quantized caches: past_key/past_value fed as int8 codes, present_* come back as int8 codes; needs
  kv_cache_bit_width=8 and k_quant_type == v_quant_type; k_scale/v_scale float32 of shape (1,)
  (PER_TENSOR) or (1, Hk, 1, D) (PER_CHANNEL). New K/V are quantized into the cache and attention reads
  the dequantized codes for every key, the new ones included (also with P = 0). float16 T works too.
- causal=0 (cupa's is_causal=0) needs local_window_size=-1 and rejects query_seqlens: such calls run
  one sequence at a time.
- The CPU provider rejects q_norm_weight/k_norm_weight (so RMSNorm, and the RoPE after it, run here in
  float64 before GQA) and bfloat16.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

MIN_ORT_VERSION = (1, 32)

#: GroupQueryAttention's inputs, in ONNX order.
GQA_INPUT_NAMES = (
    "query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
    "cos_cache", "sin_cache", "position_ids", "attention_bias", "head_sink", "k_scale", "v_scale",
    "q_norm_weight", "k_norm_weight", "query_seqlens",
)
GQA_OUTPUT_NAMES = ("output", "present_key", "present_value", "output_qk")


def ort_version() -> Optional[tuple]:
    """(major, minor) of the installed onnxruntime, or None when it is missing."""
    try:
        import onnxruntime
    except ImportError:
        return None
    return tuple(int(part) for part in onnxruntime.__version__.split(".")[:2])


@functools.lru_cache(maxsize=64)
def _session(signature: tuple, attributes: tuple, num_outputs: int):
    """One GroupQueryAttention node on the CPU provider; shapes left dynamic so sessions are reused."""
    import onnxruntime as ort
    from onnx import helper

    node_inputs, graph_inputs = [], []
    for name, dtype in signature:
        if dtype is None:
            node_inputs.append("")
            continue
        node_inputs.append(name)
        graph_inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), None))
    outputs = list(GQA_OUTPUT_NAMES[:num_outputs])
    node = helper.make_node("GroupQueryAttention", node_inputs, outputs, domain="com.microsoft", **dict(attributes))
    graph = helper.make_graph([node], "gqa_oracle", graph_inputs,
                              [helper.make_empty_tensor_value_info(name) for name in outputs])
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]), outputs


def run_gqa(inputs: Mapping[str, Optional[np.ndarray]], attributes: Mapping[str, Any], num_outputs: int = 3) -> list:
    """Run one GroupQueryAttention node on ONNX Runtime's CPU provider.

    ``inputs`` maps GQA input names to arrays (absent or None = not given); returns the first
    ``num_outputs`` outputs (output, present_key, present_value[, output_qk]).
    """
    unknown = set(inputs) - set(GQA_INPUT_NAMES)
    if unknown:
        raise ValueError(f"unknown GroupQueryAttention inputs {sorted(unknown)}")
    last = max(i for i, name in enumerate(GQA_INPUT_NAMES) if inputs.get(name) is not None)
    signature = tuple((name, None if inputs.get(name) is None else np.asarray(inputs[name]).dtype.str)
                      for name in GQA_INPUT_NAMES[:last + 1])
    session, outputs = _session(signature, tuple(sorted(attributes.items())), num_outputs)
    feeds = {name: np.ascontiguousarray(inputs[name]) for name, dtype in signature if dtype is not None}
    return session.run(outputs, feeds)


@dataclass
class GqaResult:
    """What a cupa call must produce, according to GroupQueryAttention.

    output : (N, H*D) of T, row t for packed token t.
    key_rows, value_rows : (N, Hk, D) of the cache dtype: what token t's cache write must hold.
    output_qk : (H, N, kv_width) float32 or None; only entries a token admits are meaningful.
    """

    output: np.ndarray
    key_rows: np.ndarray
    value_rows: np.ndarray
    output_qk: Optional[np.ndarray]
    kv_width: int


def _prologue(x: np.ndarray, heads: int, dtype, norm: Optional[dict], rope: Optional[dict]) -> np.ndarray:
    """Per-head RMSNorm and/or RoPE in float64, rounded to T once (contract §4.1).

    For the prologue steps GQA cannot be given: its CPU provider rejects the norm weights, and a
    rotation done by GQA on normalized values would round to T twice.
    """
    n = x.shape[0]
    xh = x.astype(np.float64).reshape(n, heads, -1)
    if norm is not None:
        rms = np.sqrt(np.mean(xh * xh, axis=-1, keepdims=True) + norm["epsilon"])
        xh = xh / rms * norm["weight"].astype(np.float64)
    if rope is not None:
        cos = rope["cos"].astype(np.float64)[rope["positions"]][:, None, :]
        sin = rope["sin"].astype(np.float64)[rope["positions"]][:, None, :]
        half, start = cos.shape[-1], rope["offset"]
        channels = np.arange(start, start + 2 * half)
        first, second = (channels[0::2], channels[1::2]) if rope["interleaved"] else (channels[:half], channels[half:])
        a, b = xh[..., first].copy(), xh[..., second].copy()
        xh[..., first], xh[..., second] = a * cos - b * sin, a * sin + b * cos
    return xh.reshape(n, -1).astype(dtype)


def _dequantized(rows: np.ndarray, scale: Optional[np.ndarray], dtype) -> np.ndarray:
    """Cache rows (N, Hk, D) as T values; quantized rows as code * scale (float32, then T).

    GQA requantizes them to the same codes: |code| <= 128, so even float16's rounding of
    code * scale stays far from a rounding boundary.
    """
    if scale is None:
        return rows.astype(dtype)
    scale = scale.reshape(-1, rows.shape[-1]) if scale.size > 1 else scale.reshape(())
    return (rows.astype(np.float32) * scale.astype(np.float32)).astype(dtype)


def _roll_heads(x: np.ndarray, heads: int, shift: int) -> np.ndarray:
    """Roll the channels of each head of (N, heads*D) by ``shift`` (np.roll semantics)."""
    n = x.shape[0]
    return np.roll(x.reshape(n, heads, -1), shift, axis=-1).reshape(n, -1)


def gqa_oracle(inputs: Mapping[str, Any], *, num_heads: int, kv_num_heads: int, scale: float = 0.0,
               softcap: float = 0.0, local_window_size: int = -1, is_causal: int = 1, do_rotary: int = 0,
               rotary_interleaved: int = 0, rotary_offset: int = 0, qk_norm_epsilon: float = 1e-6,
               k_quant_type: str = "NONE", v_quant_type: str = "NONE", k_cache_dtype: str = "",
               v_cache_dtype: str = "", kv_cache_layout: str = "SEPARATE", v_head_size: int = 0,
               qk_output: int = 0, smooth_softmax: Optional[int] = None,
               written_rows: Optional[tuple] = None) -> GqaResult:
    """Run a cupa call's inputs through ONNX Runtime's CPU GroupQueryAttention (contract §6).

    ``inputs`` maps cupa input names (contract §1) to NumPy arrays as they are BEFORE the cupa call
    (the caches unmodified); the attributes are cupa's. ``smooth_softmax`` is passed to GQA as is.
    Supported: SEPARATE layout (split or packed QKV), float16/float32 T, T caches or int8 caches with
    one quantization granularity, rotary (any offset), QK-norm, head_sink, attention_bias, softcap,
    windows, scale, qk_output, is_causal=0 without a window. Every sequence must be valid (contract §4.4),
    and slot_mapping and query_positions must be absent.

    ``written_rows = (key_rows, value_rows)``, each (N, Hk, D) of the cache dtype, makes the new tokens
    hold exactly those cache rows (e.g. what cupa wrote, when a quantized write legitimately differs
    from GQA's by one code): RoPE then runs here, in float64, and GQA is fed the dequantized rows,
    which it writes back as the same codes. The attention is then compared on identical caches.
    """
    get = lambda name: None if inputs.get(name) is None else np.asarray(inputs[name])
    H, Hk = int(num_heads), int(kv_num_heads)
    if kv_cache_layout != "SEPARATE" or v_head_size not in (0, None):
        raise NotImplementedError("GQA has no LATENT layout")
    for name in ("slot_mapping", "query_positions"):
        if get(name) is not None:
            raise NotImplementedError(f"GQA has no equivalent of {name}")
    query = get("query")
    dtype = query.dtype
    if dtype not in (np.float16, np.float32):
        raise NotImplementedError(f"GQA's CPU provider takes float16/float32, got {dtype}")
    key, value = get("key"), get("value")
    if key is None:
        D = query.shape[1] // (H + 2 * Hk)
        query, key, value = query[:, :H * D], query[:, H * D:(H + Hk) * D], query[:, (H + Hk) * D:]
    else:
        D = query.shape[1] // H
    key_cache, value_cache = get("key_cache"), get("value_cache")
    cache_dtype = key_cache.dtype
    block_size = key_cache.shape[1]
    cum = get("cumulative_sequence_length").astype(np.int64)
    past = get("past_seqlens").astype(np.int64)
    table = get("block_table").astype(np.int64)
    B = past.shape[0]
    q_lens = np.diff(cum)
    N = query.shape[0]
    if cum[0] != 0 or cum[-1] != N or (q_lens < 0).any() or (past < 0).any():
        raise NotImplementedError("the oracle takes valid sequences that own every packed token")
    if ((past + q_lens) > table.shape[1] * block_size).any():
        raise NotImplementedError("the oracle takes sequences that fit their block_table row")
    quantized = k_quant_type != "NONE" or v_quant_type != "NONE"
    if quantized and (k_quant_type != v_quant_type or cache_dtype != np.int8):
        raise NotImplementedError("GQA's CPU provider takes int8 caches with k_quant_type == v_quant_type")

    # Prologue steps GQA cannot do. A rotary offset is a channel roll of Q and K; QK-norm (and the
    # RoPE after it, so that Q and K round to T once) runs here, as does RoPE with written_rows.
    shift = -int(rotary_offset) if do_rotary else 0
    norm = None
    if get("q_norm_weight") is not None:
        norm = (dict(weight=get("q_norm_weight"), epsilon=qk_norm_epsilon),
                dict(weight=get("k_norm_weight"), epsilon=qk_norm_epsilon))
    if norm is not None or written_rows is not None:
        rope = None
        if do_rotary:
            positions = np.concatenate([past[b] + np.arange(q_lens[b]) for b in range(B)] or [[]])
            rope = dict(cos=get("cos_cache"), sin=get("sin_cache"), positions=positions.astype(np.int64),
                        interleaved=rotary_interleaved, offset=rotary_offset)
        query = _prologue(query, H, dtype, None if norm is None else norm[0], rope)
        key = _prologue(key, Hk, dtype, None if norm is None else norm[1], rope)
        do_rotary, shift = 0, 0
    if written_rows is not None:
        key, value = (_dequantized(rows, get(scale_name), dtype).reshape(N, -1)
                      for rows, scale_name in zip(written_rows, ("k_scale", "v_scale")))
    query, key = _roll_heads(query, H, shift), _roll_heads(key, Hk, shift)

    def paged_rows(cache: np.ndarray, b: int, positions: np.ndarray) -> np.ndarray:
        """(len(positions), Hk, D) rows of sequence b at logical positions."""
        return cache[table[b, positions // block_size], positions % block_size]

    k_scale, v_scale = get("k_scale"), get("v_scale")
    if k_scale is not None and k_scale.size > 1:
        k_scale = np.roll(k_scale.reshape(1, Hk, 1, D), shift, axis=-1)
        v_scale = v_scale.reshape(1, Hk, 1, D)
    attributes = dict(num_heads=H, kv_num_heads=Hk, scale=float(scale), softcap=float(softcap),
                      local_window_size=int(local_window_size), do_rotary=int(do_rotary),
                      rotary_interleaved=int(rotary_interleaved), qk_output=int(qk_output))
    if quantized:
        attributes.update(k_quant_type=k_quant_type, v_quant_type=v_quant_type, kv_cache_bit_width=8)
    if smooth_softmax is not None:
        attributes["smooth_softmax"] = int(smooth_softmax)
    bias = get("attention_bias")

    # Non-causal GQA takes no query_seqlens and, with past, only batch 1: one call per sequence.
    if is_causal:
        groups = [[b for b in range(B) if past[b] + q_lens[b] > 0]]
    else:
        if local_window_size > 0:
            raise NotImplementedError("GQA takes causal=0 only without a window")
        attributes["causal"] = 0
        groups = [[b] for b in range(B) if q_lens[b] > 0]

    output = np.full((N, H * D), np.nan, dtype)
    key_rows = np.zeros((N, Hk, D), cache_dtype)
    value_rows = np.zeros((N, Hk, D), cache_dtype)
    widths = [int(max(past[b] + max(1, q_lens[g].max()) for b in g)) for g in groups if g]
    kv_width = max(widths, default=0)
    output_qk = np.zeros((H, N, kv_width), np.float32) if qk_output else None
    poison = np.int8(-128) if quantized else np.nan

    for group in groups:
        if not group:
            continue
        G = len(group)
        S = int(max(1, q_lens[group].max())) if is_causal else int(q_lens[group[0]])
        C = int(max(past[b] + S for b in group))
        q_pad = np.full((G, S, H * D), np.nan, dtype)
        k_pad = np.full((G, S, Hk * D), np.nan, dtype)
        v_pad = np.full((G, S, Hk * D), np.nan, dtype)
        past_key = np.full((G, Hk, C, D), poison, cache_dtype)
        past_value = np.full((G, Hk, C, D), poison, cache_dtype)
        for i, b in enumerate(group):
            tokens = slice(cum[b], cum[b + 1])
            q_pad[i, :q_lens[b]] = query[tokens]
            k_pad[i, :q_lens[b]] = key[tokens]
            v_pad[i, :q_lens[b]] = value[tokens]
            positions = np.arange(past[b])
            past_key[i, :, :past[b]] = np.roll(paged_rows(key_cache, b, positions), shift, axis=-1).transpose(1, 0, 2)
            past_value[i, :, :past[b]] = paged_rows(value_cache, b, positions).transpose(1, 0, 2)
        feeds = dict(query=q_pad, key=k_pad, value=v_pad, past_key=past_key, past_value=past_value,
                     seqlens_k=(past[group] + q_lens[group] - 1).astype(np.int32),
                     total_sequence_length=np.array([C], np.int32), head_sink=get("head_sink"),
                     k_scale=k_scale, v_scale=v_scale)
        if is_causal:
            feeds["query_seqlens"] = q_lens[group].astype(np.int32)
        if do_rotary:
            # GQA wants a row for every position below total_sequence_length; the rows added here
            # are only reached by padding rows (valid tokens have p < cos_cache.shape[0]).
            cos, sin = get("cos_cache"), get("sin_cache")
            extra = max(0, C - cos.shape[0])
            feeds["cos_cache"] = np.concatenate([cos, np.ones((extra, cos.shape[1]), cos.dtype)])
            feeds["sin_cache"] = np.concatenate([sin, np.zeros((extra, sin.shape[1]), sin.dtype)])
        if bias is not None:
            rows = bias[group] if bias.shape[0] > 1 else bias
            dense = np.zeros(rows.shape[:2] + (S, C), dtype)
            q_cap, kv_cap = min(S, rows.shape[2]), min(C, rows.shape[3])
            dense[:, :, :q_cap, :kv_cap] = rows[:, :, :q_cap, :kv_cap]
            feeds["attention_bias"] = dense
        results = run_gqa(feeds, attributes, 4 if qk_output else 3)
        out, present_key, present_value = results[:3]
        for i, b in enumerate(group):
            n, tokens = q_lens[b], slice(cum[b], cum[b + 1])
            output[tokens] = out[i, :n]
            rows = slice(past[b], past[b] + n)
            key_rows[tokens] = np.roll(present_key[i, :, rows].transpose(1, 0, 2), -shift, axis=-1)
            value_rows[tokens] = present_value[i, :, rows].transpose(1, 0, 2)
            if qk_output:
                output_qk[:, tokens, :C] = results[3][i, :, :n].astype(np.float32)
    return GqaResult(output=output, key_rows=key_rows, value_rows=value_rows, output_qk=output_qk,
                     kv_width=kv_width)
