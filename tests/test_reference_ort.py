"""The NumPy reference against ONNX Runtime's CPU GroupQueryAttention (contract §6).

Each test builds a random paged batch (shuffled block tables, ragged sequences, idle sequences that
have a past but no new token, one sequence with neither), runs ``cupa.paged_attention`` on NumPy
inputs (the reference backend) and :func:`tests.oracles.ort_gqa.gqa_oracle` on the same inputs, and
compares the output (relative error ``||out-ref||/||ref||``), every written cache row (one ulp of T,
or one int8 code), output_qk on the entries a token admits, and that nothing else in the caches moved.

The cross product is covered sparsely: one axis at a time with the others at the defaults of
:class:`Case`, a handful of combined cases, and random combinations drawn from the test's seed
(``CUPA_TEST_SEED`` replays one).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest

from .oracles.ort_gqa import MIN_ORT_VERSION, gqa_oracle, ort_version

_ORT = ort_version()
if _ORT is None:
    pytest.skip("onnxruntime is not installed", allow_module_level=True)
if _ORT < MIN_ORT_VERSION:
    pytest.skip(f"onnxruntime {'.'.join(map(str, _ORT))} < {'.'.join(map(str, MIN_ORT_VERSION))}: its "
                "GroupQueryAttention lacks query_seqlens", allow_module_level=True)
pytest.importorskip("onnx")

import cupa  # noqa: E402

#: Relative-error bounds for the output. contract §6 allows a CUDA backend 1e-5 (float32) and
#: 2e-3 (float16) against the reference; ONNX Runtime's CPU provider computes in float32 and rounds at
#: the same points as the reference, so the oracle holds it ~10x tighter (observed: ~4e-7 and ~4e-5).
TOLERANCE = {"float32": 2e-6, "float16": 2e-4}
#: output_qk: GQA returns it in T, so float16 scores carry float16 rounding (~2e-4); the reference's
#: are float32. Float16 therefore gets the contract bound.
QK_TOLERANCE = {"float32": 2e-6, "float16": 2e-3}


@dataclass(frozen=True)
class Case:
    """One oracle comparison; the defaults are the centre of the matrix."""

    num_heads: int = 8
    kv_num_heads: int = 2
    head_size: int = 64
    block_size: int = 16
    dtype: str = "float32"
    # Ragged: chunked prefill, decode, idle (past, no new token), prefill, neither (left out of GQA).
    q_lens: tuple = (5, 1, 0, 12, 0, 3)
    past_lens: tuple = (17, 40, 9, 0, 0, 33)
    quant: str = "NONE"                       # k_quant_type == v_quant_type (int8 cache when not NONE)
    rotary: Optional[tuple] = None            # (rotary_dim, interleaved, rotary_offset)
    window: int = -1
    softcap: float = 0.0
    head_sink: bool = False
    smooth_softmax: bool = False              # GQA smooth_softmax=1 against cupa head_sink = 0
    qk_output: int = 0
    bias: Optional[tuple] = None              # (batch dim is B, head dim is H); else broadcast 1
    scale: float = 0.0
    qk_norm: bool = False
    packed: bool = False
    is_causal: int = 1
    query_gain: float = 1.5                   # query magnitude: sharper softmax than N(0, 1)

    def replace(self, **changes) -> "Case":
        return dataclasses.replace(self, **changes)

    def attributes(self) -> dict:
        attrs = dict(num_heads=self.num_heads, kv_num_heads=self.kv_num_heads, scale=self.scale,
                     softcap=self.softcap, local_window_size=self.window, is_causal=self.is_causal,
                     k_quant_type=self.quant, v_quant_type=self.quant, qk_output=self.qk_output)
        if self.rotary is not None:
            attrs.update(do_rotary=1, rotary_interleaved=self.rotary[1], rotary_offset=self.rotary[2])
        return attrs


def build_inputs(case: Case, rng: np.random.Generator) -> dict:
    """Random paged inputs for ``case`` (cupa input names), with a shuffled block table."""
    T = np.dtype(case.dtype)
    H, Hk, D, bs = case.num_heads, case.kv_num_heads, case.head_size, case.block_size
    q_lens = np.array(case.q_lens, np.int64)
    past = np.array(case.past_lens, np.int64)
    B, N = len(q_lens), int(q_lens.sum())
    kv_lens = past + q_lens
    blocks_needed = -(-kv_lens // bs)
    max_blocks = int(blocks_needed.max()) + 1
    num_blocks = int(blocks_needed.sum()) + 3
    physical = rng.permutation(num_blocks)
    table = np.full((B, max_blocks), -1, np.int32)
    used = 0
    for b in range(B):
        table[b, :blocks_needed[b]] = physical[used:used + blocks_needed[b]]
        used += blocks_needed[b]
        # Entries past kv_len are never read nor written: some unmapped, some aliasing live blocks.
        tail = np.arange(blocks_needed[b], max_blocks)
        alias = rng.random(tail.size) < 0.5
        table[b, tail[alias]] = rng.integers(0, num_blocks, alias.sum())
    cache_shape = (num_blocks, bs, Hk, D)
    if case.quant == "NONE":
        key_cache = rng.standard_normal(cache_shape).astype(T)
        value_cache = rng.standard_normal(cache_shape).astype(T)
    else:
        key_cache = rng.integers(-127, 128, cache_shape).astype(np.int8)
        value_cache = rng.integers(-127, 128, cache_shape).astype(np.int8)
    query = (case.query_gain * rng.standard_normal((N, H * D))).astype(T)
    key = rng.standard_normal((N, Hk * D)).astype(T)
    value = rng.standard_normal((N, Hk * D)).astype(T)
    inputs = dict(query=query, key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                  cumulative_sequence_length=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                  past_seqlens=past.astype(np.int32), block_table=table)
    if case.packed:
        inputs.update(query=np.concatenate([query, key, value], axis=1), key=None, value=None)
    if case.rotary is not None:
        rotary_dim = case.rotary[0]
        # Random angles rotate every pair visibly (a smooth RoPE table barely turns its last pairs).
        angles = rng.uniform(-math.pi, math.pi, (int(kv_lens.max()) + 5, rotary_dim // 2))
        inputs.update(cos_cache=np.cos(angles).astype(T), sin_cache=np.sin(angles).astype(T))
    if case.head_sink:
        inputs["head_sink"] = rng.standard_normal(H).astype(T)
    if case.smooth_softmax:
        inputs["head_sink"] = np.zeros(H, T)
    if case.qk_norm:
        inputs["q_norm_weight"] = rng.uniform(0.5, 1.5, D).astype(T)
        inputs["k_norm_weight"] = rng.uniform(0.5, 1.5, D).astype(T)
    if case.quant == "PER_TENSOR":
        inputs["k_scale"] = rng.uniform(0.015, 0.03, 1).astype(np.float32)
        inputs["v_scale"] = rng.uniform(0.015, 0.03, 1).astype(np.float32)
    elif case.quant == "PER_CHANNEL":
        inputs["k_scale"] = rng.uniform(0.01, 0.04, (Hk, 1, D)).astype(np.float32)
        inputs["v_scale"] = rng.uniform(0.01, 0.04, (Hk, 1, D)).astype(np.float32)
    if case.bias is not None:
        shape = (B if case.bias[0] else 1, H if case.bias[1] else 1,
                 max(1, int(q_lens.max())) + 1, int(kv_lens.max()) + 3)
        inputs["attention_bias"] = rng.standard_normal(shape).astype(T)
    return inputs


def admitted_mask(case: Case, inputs: dict, width: int) -> np.ndarray:
    """(N, width) bool: the keys each token attends (contract §4.2; every block used here is mapped)."""
    cum, past = inputs["cumulative_sequence_length"], inputs["past_seqlens"]
    rows = []
    for b in range(len(past)):
        for j in range(cum[b + 1] - cum[b]):
            p, k = past[b] + j, np.arange(width)
            ok = k < past[b] + cum[b + 1] - cum[b]
            if case.is_causal:
                ok &= k <= p
            if case.window > 0:
                ok &= k > p - case.window
            rows.append(ok)
    return np.array(rows, bool).reshape(-1, width)


def written_slots(inputs: dict) -> np.ndarray:
    """(N,) flat cache slot each token writes (derived from block_table, contract §4.1)."""
    cum, past, table = inputs["cumulative_sequence_length"], inputs["past_seqlens"], inputs["block_table"]
    bs = inputs["key_cache"].shape[1]
    slots = []
    for b in range(len(past)):
        p = past[b] + np.arange(cum[b + 1] - cum[b])
        slots.append(table[b, p // bs].astype(np.int64) * bs + p % bs)
    return np.concatenate(slots).astype(np.int64)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def rotation_magnitude(rows: np.ndarray, rotary: Optional[tuple]) -> np.ndarray:
    """|x| per element, except on rotated channels, where it is the norm of the element's RoPE pair.

    GQA rotates in float32: each product is rounded at the scale of the pair it rotates, so where a
    rotation cancels, one ulp of the (small) result is finer than any float32 rotation can reach.
    """
    magnitude = np.abs(rows.astype(np.float64))
    if rotary is None:
        return magnitude
    rotary_dim, interleaved, offset = rotary
    channels = np.arange(offset, offset + rotary_dim)
    first, second = ((channels[0::2], channels[1::2]) if interleaved
                     else (channels[:rotary_dim // 2], channels[rotary_dim // 2:]))
    pair = np.hypot(rows[..., first].astype(np.float64), rows[..., second].astype(np.float64))
    magnitude[..., first] = pair
    magnitude[..., second] = pair
    return magnitude


def assert_cache_rows(got: np.ndarray, want: np.ndarray, what: str, rotary: Optional[tuple] = None):
    """T caches: within one ulp of T (at the RoPE pair's scale on rotated channels); int8: one code."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, GQA wrote {want.dtype}"
    if got.dtype == np.int8:
        diff = np.abs(got.astype(np.int32) - want.astype(np.int32))
        assert diff.max(initial=0) <= 1, f"{what}: {np.count_nonzero(diff > 1)} codes differ by more than one"
        return
    scale = np.maximum(np.abs(got.astype(np.float64)), rotation_magnitude(want, rotary))
    ulp = np.spacing(scale.astype(got.dtype)).astype(np.float64)
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    bad = ~(diff <= ulp)
    assert not bad.any(), (f"{what}: {np.count_nonzero(bad)} of {bad.size} values beyond one ulp of {got.dtype}; "
                           f"worst {diff[bad].max()} (got {got[bad][:4]}, GQA {want[bad][:4]})")


def check_against_gqa(case: Case, rng: np.random.Generator) -> dict:
    """Run the reference and GQA on one random batch of ``case``; assert they agree. Returns errors."""
    inputs = build_inputs(case, rng)
    attrs = case.attributes()
    oracle = gqa_oracle(inputs, smooth_softmax=1 if case.smooth_softmax else None, **attrs)

    key_cache, value_cache = inputs["key_cache"].copy(), inputs["value_cache"].copy()
    result = cupa.paged_attention(**dict(inputs, key_cache=key_cache, value_cache=value_cache), **attrs)
    output, output_qk = result if case.qk_output else (result, None)

    tol = TOLERANCE[case.dtype]
    N, H, Hk, D = output.shape[0], case.num_heads, case.kv_num_heads, case.head_size
    assert output.shape == (N, H * D) and output.dtype == np.dtype(case.dtype)

    slots = written_slots(inputs)
    written = []
    for name, cache, before, want, rotary in (
            ("key_cache", key_cache, inputs["key_cache"], oracle.key_rows, case.rotary),
            ("value_cache", value_cache, inputs["value_cache"], oracle.value_rows, None)):
        flat, flat_before = cache.reshape(-1, Hk, D), before.reshape(-1, Hk, D)
        assert_cache_rows(flat[slots], want, f"{name} rows written", rotary)
        written.append(flat[slots])
        untouched = np.ones(flat.shape[0], bool)
        untouched[slots] = False
        assert np.array_equal(flat[untouched].view(np.uint8), flat_before[untouched].view(np.uint8)), \
            f"{name}: slots no token writes changed"
    if case.quant != "NONE" and not all(np.array_equal(got, want) for got, want
                                        in zip(written, (oracle.key_rows, oracle.value_rows))):
        # A code one off (a value at a rounding boundary, e.g. after a float32 rotation in GQA) is
        # a legitimate difference that moves the output by far more than the tolerance: compare the
        # attention on identical caches, holding the codes the reference wrote.
        oracle = gqa_oracle(inputs, smooth_softmax=1 if case.smooth_softmax else None,
                            written_rows=tuple(written), **attrs)

    errors = {"output": relative_error(output, oracle.output)}
    assert errors["output"] < tol, f"output: relative error {errors['output']:.3g} >= {tol}"

    if case.qk_output:
        cap = inputs["block_table"].shape[1] * case.block_size
        assert output_qk.shape == (H, N, cap) and output_qk.dtype == np.float32
        width = min(cap, oracle.kv_width)
        admitted = admitted_mask(case, inputs, cap)
        assert not admitted[:, width:].any()
        assert np.all(output_qk[:, ~admitted] == 0), "output_qk: masked entries are not 0"
        got = output_qk[:, :, :width][:, admitted[:, :width]]
        want = oracle.output_qk[:, :, :width][:, admitted[:, :width]]
        errors["output_qk"] = relative_error(got, want)
        qk_tol = QK_TOLERANCE[case.dtype]
        assert errors["output_qk"] < qk_tol, f"output_qk: relative error {errors['output_qk']:.3g} >= {qk_tol}"
    return errors


DTYPES = ["float32", "float16"]
BASE = Case()


# -- one axis at a time ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (16, 2)], ids=["ratio1", "ratio4", "ratio8"])
def test_gqa_ratio(rng, heads, dtype):
    check_against_gqa(BASE.replace(num_heads=heads[0], kv_num_heads=heads[1], dtype=dtype), rng)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_head_size(rng, head_size, dtype):
    check_against_gqa(BASE.replace(head_size=head_size, dtype=dtype), rng)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_block_size(rng, block_size, dtype):
    check_against_gqa(BASE.replace(block_size=block_size, dtype=dtype), rng)


SHAPES = {
    "decode": ((1, 1, 1, 1), (31, 0, 77, 6)),
    "decode_with_idle": ((1, 0, 1, 0, 1), (12, 50, 0, 3, 64)),
    "prefill": ((37, 9, 1, 20), (0, 0, 0, 0)),
    "chunked_prefill": ((16, 16, 7), (32, 5, 100)),
    "single_sequence": ((23,), (41,)),
    "idle_and_empty": ((0, 4, 0, 0), (8, 0, 0, 19)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_batch_shape(rng, shape, dtype):
    q_lens, past_lens = SHAPES[shape]
    check_against_gqa(BASE.replace(q_lens=q_lens, past_lens=past_lens, dtype=dtype), rng)


def test_wide_random_batch(rng):
    B = 24
    q_lens = tuple(int(x) for x in rng.choice([0, 1, 1, 2, 5, 17], B))
    past_lens = tuple(int(x) for x in rng.integers(0, 90, B))
    check_against_gqa(BASE.replace(q_lens=q_lens, past_lens=past_lens), rng)


ROTARY = {
    "half_full": (64, 0, 0),
    "interleaved_full": (64, 1, 0),
    "half_partial": (32, 0, 0),
    "interleaved_partial": (16, 1, 0),
    "half_offset": (32, 0, 16),
    "interleaved_offset": (16, 1, 48),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary", list(ROTARY))
def test_rotary(rng, rotary, dtype):
    check_against_gqa(BASE.replace(rotary=ROTARY[rotary], dtype=dtype), rng)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 3, 16, 40, 1000])
def test_window(rng, window, dtype):
    check_against_gqa(BASE.replace(window=window, dtype=dtype), rng)


def test_window_float16_decode(rng):
    check_against_gqa(BASE.replace(window=7, dtype="float16", q_lens=(1, 1, 0, 1), past_lens=(30, 2, 9, 70)), rng)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [1.0, 8.0])
def test_softcap(rng, softcap, dtype):
    check_against_gqa(BASE.replace(softcap=softcap, query_gain=3.0, dtype=dtype), rng)


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_sink(rng, dtype):
    check_against_gqa(BASE.replace(head_sink=True, dtype=dtype), rng)


def test_zero_head_sink_is_smooth_softmax(rng):
    check_against_gqa(BASE.replace(smooth_softmax=True), rng)


@pytest.mark.parametrize("scale", [0.05, 0.3])
def test_explicit_scale(rng, scale):
    check_against_gqa(BASE.replace(scale=scale), rng)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [(True, True), (False, False), (True, False), (False, True)],
                         ids=["BxH", "1x1", "Bx1", "1xH"])
def test_attention_bias(rng, bias, dtype):
    check_against_gqa(BASE.replace(bias=bias, dtype=dtype), rng)


QK_OUTPUT = {
    "plain": {},
    "softcap": dict(softcap=2.0, query_gain=3.0),
    "bias": dict(bias=(True, True)),
    "window": dict(window=5),
    "head_sink": dict(head_sink=True),
    "float16": dict(dtype="float16"),
    "decode_block1": dict(q_lens=(1, 0, 1), past_lens=(20, 4, 0), block_size=1),
}


@pytest.mark.parametrize("variant", list(QK_OUTPUT))
@pytest.mark.parametrize("qk_output", [1, 2])
def test_qk_output(rng, qk_output, variant):
    check_against_gqa(BASE.replace(qk_output=qk_output, **QK_OUTPUT[variant]), rng)


INT8_SHAPES = {
    "ragged": {},
    "decode": dict(q_lens=SHAPES["decode_with_idle"][0], past_lens=SHAPES["decode_with_idle"][1]),
    "prefill": dict(q_lens=SHAPES["prefill"][0], past_lens=SHAPES["prefill"][1]),
}


@pytest.mark.parametrize("shape", list(INT8_SHAPES))
@pytest.mark.parametrize("quant", ["PER_TENSOR", "PER_CHANNEL"])
def test_int8_cache(rng, quant, shape):
    check_against_gqa(BASE.replace(quant=quant, **INT8_SHAPES[shape]), rng)


INT8_FEATURES = {
    "float16": dict(dtype="float16"),
    "rotary_half": dict(rotary=(64, 0, 0)),
    "rotary_interleaved_offset": dict(rotary=(32, 1, 8)),
    "window": dict(window=6),
    "scores": dict(qk_output=1),
    "probabilities": dict(qk_output=2, head_sink=True),
    "block1_ratio8": dict(block_size=1, num_heads=16, kv_num_heads=2),
    "block64_head256": dict(block_size=64, head_size=256),
}


@pytest.mark.parametrize("feature", list(INT8_FEATURES))
@pytest.mark.parametrize("quant", ["PER_TENSOR", "PER_CHANNEL"])
def test_int8_cache_with(rng, quant, feature):
    check_against_gqa(BASE.replace(quant=quant, **INT8_FEATURES[feature]), rng)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm(rng, dtype):
    check_against_gqa(BASE.replace(qk_norm=True, dtype=dtype), rng)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_qkv(rng, dtype):
    check_against_gqa(BASE.replace(packed=True, dtype=dtype), rng)


@pytest.mark.parametrize("dtype", DTYPES)
def test_not_causal(rng, dtype):
    check_against_gqa(BASE.replace(is_causal=0, dtype=dtype), rng)


# -- combined cases ----------------------------------------------------------------------------

COMBINED = {
    "gpt_oss_like": dict(num_heads=16, kv_num_heads=2, rotary=(64, 0, 0), window=8, head_sink=True,
                         dtype="float16", block_size=1),
    "gemma_like": dict(num_heads=8, kv_num_heads=4, head_size=256, rotary=(256, 0, 0), softcap=5.0,
                       window=20, block_size=64, query_gain=3.0),
    "int8_rotary_window": dict(quant="PER_CHANNEL", rotary=(32, 1, 16), window=10, qk_output=2, block_size=1),
    "int8_sink_bias": dict(quant="PER_TENSOR", head_sink=True, bias=(True, False), num_heads=16,
                           kv_num_heads=2, head_size=128, qk_output=1),
    "qwen3_like": dict(qk_norm=True, rotary=(128, 0, 0), head_size=128, num_heads=16, kv_num_heads=2,
                       dtype="float16", q_lens=(1, 1, 9, 0), past_lens=(70, 3, 0, 12), block_size=64),
    "packed_rotary_scores": dict(packed=True, rotary=(64, 1, 0), qk_output=1, scale=0.2, window=1000,
                                 num_heads=4, kv_num_heads=4),
    "not_causal_rotary_sink": dict(is_causal=0, rotary=(64, 0, 0), head_sink=True, qk_output=2,
                                   num_heads=16, kv_num_heads=2, block_size=1),
    "long_context": dict(q_lens=(1, 1, 24, 0, 1), past_lens=(2047, 900, 1500, 3000, 0), head_size=128,
                         num_heads=32, kv_num_heads=8, dtype="float16", rotary=(128, 0, 0), window=1024),
}


@pytest.mark.parametrize("name", list(COMBINED))
def test_combined(rng, name):
    check_against_gqa(BASE.replace(**COMBINED[name]), rng)


def random_case(rng: np.random.Generator) -> Case:
    """A random valid combination of every axis GQA can check (never bias with softcap)."""
    pick = lambda options: options[int(rng.integers(len(options)))]
    num_heads, kv_num_heads = pick([(4, 4), (8, 2), (16, 2), (6, 3), (8, 1)])
    head_size = pick([64, 96, 128, 256])
    batch = int(rng.integers(1, 7))
    q_lens = [int(x) for x in rng.choice([0, 1, 1, 2, 7, 20], batch)]
    if sum(q_lens) == 0:
        q_lens[0] = 1
    is_causal = int(rng.random() < 0.85)
    case = dict(num_heads=num_heads, kv_num_heads=kv_num_heads, head_size=head_size,
                block_size=pick([1, 3, 16, 64]), dtype=pick(DTYPES), q_lens=tuple(q_lens),
                past_lens=tuple(int(x) for x in rng.integers(0, 150, batch)), is_causal=is_causal,
                quant=pick(["NONE", "NONE", "PER_TENSOR", "PER_CHANNEL"]), head_sink=bool(rng.random() < 0.3),
                qk_output=pick([0, 0, 1, 2]), qk_norm=bool(rng.random() < 0.2), packed=bool(rng.random() < 0.2),
                scale=pick([0.0, 0.0, float(rng.uniform(0.05, 0.3))]))
    if rng.random() < 0.6:
        rotary_dim = 16 * int(rng.integers(1, head_size // 16 + 1))
        offset = 8 * int(rng.integers(0, (head_size - rotary_dim) // 8 + 1))
        case["rotary"] = (rotary_dim, int(rng.integers(2)), offset)
    if is_causal and rng.random() < 0.5:
        case["window"] = int(rng.integers(1, 60))
    extra = pick(["none", "softcap", "bias"])
    if extra == "softcap":
        case.update(softcap=float(rng.uniform(1.0, 10.0)), query_gain=3.0)
    elif extra == "bias":
        case["bias"] = (bool(rng.integers(2)), bool(rng.integers(2)))
    return Case(**case)


@pytest.mark.parametrize("draw", range(24))
def test_random_configuration(rng, draw):
    case = random_case(rng)
    try:
        check_against_gqa(case, rng)
    except AssertionError as error:
        raise AssertionError(f"{case}: {error}") from None


@pytest.mark.parametrize("quant", ["PER_TENSOR", "PER_CHANNEL"])
def test_oracle_written_rows_path(rng, quant):
    """The oracle's ``written_rows`` path (used when a code is one off) reproduces GQA's own result."""
    dtype = "float16" if quant == "PER_TENSOR" else "float32"
    case = BASE.replace(quant=quant, rotary=(32, 1, 8), qk_output=1, dtype=dtype)
    inputs = build_inputs(case, rng)
    plain = gqa_oracle(inputs, **case.attributes())
    held = gqa_oracle(inputs, written_rows=(plain.key_rows, plain.value_rows), **case.attributes())
    assert np.array_equal(held.key_rows, plain.key_rows) and np.array_equal(held.value_rows, plain.value_rows)
    assert relative_error(held.output, plain.output) < TOLERANCE[case.dtype]
    admitted = admitted_mask(case, inputs, plain.kv_width)
    assert relative_error(held.output_qk[:, admitted], plain.output_qk[:, admitted]) < QK_TOLERANCE[case.dtype]
