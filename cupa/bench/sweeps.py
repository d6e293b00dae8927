"""The cases of each attention suite at each size: ``full`` (the default), ``quick`` (``--quick``: a
handful per suite) and ``smoke`` (``--smoke``: tiny shapes the NumPy reference runs in seconds).

Full sweeps (fp16, GQA 32/8, D=128, block 16 unless the sweep varies it):

- decode: context length 1k..128k at B=8 for block sizes 1, 16, 64, 256; batch 1..256 at L=4096;
  head size 64/128/256; GQA ratio MHA / 4 / 8 / MQA; bf16; int8 and fp8 caches (per channel, per
  tensor); int4 and float4 e2m1 caches (per channel, per tensor); sliding window at 32k and 128k; sinks (with and without a GPT-OSS window);
  ragged lengths; without attention_metadata.
- prefill: length 512..16k at 16k tokens per batch (block 16 and 256, fp16; block 16, bf16); the
  B=4 x 2048 rows at block sizes 1/16/64/256; head size, GQA ratio, 8-bit caches, window, sinks,
  ragged prompt lengths, no attention_metadata.
- chunked: chunks of 256/1024/2048 new tokens after 2k/8k/32k cached ones; with a window.
- mixed: decode batches with prefill chunks in the same call (continuous batching).
- mla: absorbed DeepSeek-V3 MLA (576/512, one latent row), batch and context sweeps, H=16/128.
- subbyte: int4 and float4 e2m1 caches in prefill and chunked prefill (their decode cases are the
  decode suite's).
"""

from __future__ import annotations

import numpy as np

from . import cases as C

__all__ = ["attention_cases", "SIZES"]

SIZES = ("full", "quick", "smoke")
#: Shapes of the smoke mode: small enough for the float64 reference, every sweep still present.
SMOKE = dict(num_heads=4, kv_num_heads=2, head_size=16)
#: The packed 4-bit caches (decode target, H200, B=64 L=4096 fp16 GQA 32/8 D=128 block 16: <= 75 us).
PACKED_CACHES = ("int4", "float4e2m1")


def _ragged(rng_seed: int, n: int, lo: int, hi: int) -> list:
    return np.random.default_rng(rng_seed).integers(lo, hi + 1, size=n).tolist()


def _unique(items: list) -> list:
    """``items`` without repeated ids; a repeat that carries sweep tags lends them to the first."""
    index, out = {}, []
    for c in items:
        if c.id not in index:
            index[c.id] = len(out)
            out.append(c)
        elif c.tags and not out[index[c.id]].tags:
            out[index[c.id]] = C.replace(out[index[c.id]], tags=c.tags)
    return out


def decode_cases(size: str) -> list:
    if size == "smoke":
        s = SMOKE
        out = [C.decode(2, L, block_size=bs, tags={"sweep": "context", "x": L, "series": f"block {bs}"}, **s)
               for bs in (1, 4) for L in (8, 32)]
        out += [C.decode(2, 24, block_size=4, cache="int8", **s),
                C.decode(2, 24, block_size=4, cache="fp8", quant="PER_TENSOR", **s),
                C.decode(2, 24, block_size=4, cache="int4", **s),
                C.decode(2, 24, block_size=4, cache="float4e2m1", quant="PER_TENSOR", **s),
                C.decode(2, 24, block_size=4, window=8, sinks=True, **s),
                C.decode(2, 24, block_size=4, metadata=False, **s),
                C.ragged_decode([5, 19, 33], "U[1,40]", block_size=4, **s)]
        return out
    ctx = lambda L, bs: C.decode(8, L, block_size=bs, tags={"sweep": "context", "x": L, "series": f"block {bs}"})  # noqa: E731
    if size == "quick":
        out = [C.decode(64, 4096), C.decode(16, 32768), C.decode(8, 8192), C.decode(8, 8192, metadata=False),
               C.decode(64, 4096, cache="int8"), C.decode(64, 4096, cache="fp8", quant="PER_TENSOR")]
        out += [C.decode(64, 4096, cache=cache) for cache in PACKED_CACHES]
        out += [ctx(L, bs) for bs in (16, 256) for L in (1024, 8192, 32768)]
        return _unique(out)
    out = [C.decode(64, 4096), C.decode(16, 32768), C.decode(8, 8192)]
    out += [ctx(L, bs) for bs in (1, 16, 64, 256) for L in (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)]
    out += [C.decode(B, 4096, tags={"sweep": "batch", "x": B, "series": "fp16"})
            for B in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    out += [C.decode(64, 4096, head_size=D, tags={"sweep": "head_size", "x": D}) for D in (64, 256)]
    out += [C.decode(64, 4096, num_heads=32, kv_num_heads=hk, tags={"sweep": "gqa", "x": 32 // hk})
            for hk in (32, 4, 1)]
    out += [C.decode(64, 4096, dtype="bfloat16"), C.decode(8, 8192, dtype="bfloat16")]
    out += [C.decode(64, 4096, cache=cache, quant=quant) for cache in ("int8", "fp8")
            for quant in ("PER_CHANNEL", "PER_TENSOR")]
    out += [C.decode(16, 32768, cache="fp8", quant="PER_TENSOR"), C.decode(16, 32768, cache="int8")]
    out += [C.decode(64, 4096, cache=cache, quant=quant) for cache in PACKED_CACHES
            for quant in ("PER_CHANNEL", "PER_TENSOR")]
    out += [C.decode(16, 32768, cache=cache) for cache in PACKED_CACHES]
    out += [C.decode(16, 32768, window=4096), C.decode(4, 131072, window=4096), C.decode(4, 131072, window=8192)]
    out += [C.decode(64, 4096, sinks=True), C.decode(64, 4096, window=128, sinks=True)]
    out += [C.ragged_decode(_ragged(1, 64, 1, 8192), "U[1,8192]"), C.ragged_decode(_ragged(2, 256, 1, 4096), "U[1,4096]")]
    out += [C.decode(8, 8192, metadata=False), C.decode(64, 4096, metadata=False)]
    return _unique(out)


def prefill_cases(size: str) -> list:
    if size == "smoke":
        s = SMOKE
        out = [C.prefill(2, L, block_size=4, tags={"sweep": "length", "x": L, "series": "block 4"}, **s)
               for L in (8, 16)]
        out += [C.prefill(2, 12, block_size=1, **s), C.prefill(2, 12, block_size=4, cache="fp8", **s),
                C.ragged_prefill([3, 11], "U[1,12]", block_size=4, **s)]
        return out
    length = lambda L, bs, dtype="float16": C.prefill(  # noqa: E731
        16384 // L, L, block_size=bs, dtype=dtype,
        tags={"sweep": "length", "x": L, "series": f"{'bf16' if dtype == 'bfloat16' else 'fp16'} block {bs}"})
    if size == "quick":
        return _unique([C.prefill(4, 2048), C.prefill(4, 2048, block_size=256), length(1024, 16), length(4096, 16)])
    out = [C.prefill(4, 2048, block_size=bs) for bs in (16, 256, 1, 64)]
    out += [length(L, bs) for bs in (16, 256) for L in (512, 1024, 2048, 4096, 8192, 16384)]
    out += [length(L, 16, "bfloat16") for L in (512, 1024, 2048, 4096, 8192, 16384)]
    out += [C.prefill(4, 2048, head_size=D) for D in (64, 256)]
    out += [C.prefill(4, 2048, kv_num_heads=hk) for hk in (32, 4, 1)]
    out += [C.prefill(4, 2048, cache="fp8"), C.prefill(4, 2048, cache="fp8", quant="PER_TENSOR"),
            C.prefill(4, 2048, cache="int8")]
    out += [C.prefill(1, 16384, window=4096), C.prefill(4, 2048, sinks=True), C.prefill(4, 2048, metadata=False)]
    out += [C.ragged_prefill(_ragged(3, 8, 128, 4096), "U[128,4096]")]
    return _unique(out)


def chunked_cases(size: str) -> list:
    if size == "smoke":
        return [C.chunked(2, past, 4, block_size=4, tags={"sweep": "chunk", "x": past, "series": "chunk 4"},
                          **SMOKE) for past in (8, 20)]
    if size == "quick":
        return [C.chunked(8, 8192, 512), C.chunked(4, 32768, 1024)]
    out = [C.chunked(8, 8192, 512)]
    out += [C.chunked(4, past, q, tags={"sweep": "chunk", "x": past, "series": f"chunk {q}"})
            for q in (256, 1024, 2048) for past in (2048, 8192, 32768)]
    out += [C.chunked(4, 32768, 1024, window=4096), C.chunked(4, 8192, 1024, block_size=256)]
    return _unique(out)


def mixed_cases(size: str) -> list:
    if size == "smoke":
        return [C.mixed(3, 20, [(6, 0), (4, 8)], block_size=4, **SMOKE)]
    if size == "quick":
        return [C.mixed(64, 4096, [(512, 0)])]
    return [C.mixed(64, 4096, [(512, 0)]), C.mixed(64, 4096, [(2048, 4096)]), C.mixed(128, 2048, [(1024, 8192)] * 2),
            C.mixed(256, 1024, [(256, 0)] * 4), C.mixed(32, 32768, [(4096, 0)])]


def mla_cases(size: str) -> list:
    if size == "smoke":
        return [C.mla(2, 16, num_heads=2, block_size=4), C.mla(2, 16, num_heads=2, q_len=2, block_size=4)]
    # The MLA issue's targets (H200): H=128 B=64 L=4096 <= 105 us (compute-bound), B=8 L=8192 <= 35 us,
    # H=16 B=64 L=4096 <= 75 us (memory-bound), its fp8 latent <= 42 us, chunked prefill >= 450 TFLOP/s.
    targets = [C.mla(64, 4096), C.mla(8, 8192), C.mla(64, 4096, num_heads=16),
               C.mla(64, 4096, num_heads=16, cache="fp8", quant="PER_TENSOR"), C.mla(4, 4608, q_len=512)]
    if size == "quick":
        return targets
    out = targets + [C.mla(B, 4096, tags={"sweep": "batch", "x": B, "series": "H=128"}) for B in (1, 8, 32, 64, 128)]
    out += [C.mla(64, L, tags={"sweep": "context", "x": L, "series": "H=128"}) for L in (1024, 16384)]
    out += [C.mla(64, 4096, num_heads=16), C.mla(64, 4096, block_size=1), C.mla(64, 4096, dtype="bfloat16"),
            C.mla(64, 4096, q_len=2)]
    return _unique(out)


def subbyte_cases(size: str) -> list:
    if size == "smoke":
        return [C.prefill(2, 12, block_size=4, cache="int4", suite="subbyte", **SMOKE),
                C.chunked(2, 20, 4, block_size=4, cache="float4e2m1", suite="subbyte", **SMOKE)]
    if size == "quick":
        return [C.prefill(4, 2048, cache="int4", suite="subbyte")]
    return [C.prefill(4, 2048, cache=k, suite="subbyte") for k in PACKED_CACHES] + [
        C.chunked(4, 8192, 1024, cache=k, suite="subbyte") for k in PACKED_CACHES]


_BUILDERS = {"decode": decode_cases, "prefill": prefill_cases, "chunked": chunked_cases, "mixed": mixed_cases,
             "mla": mla_cases, "subbyte": subbyte_cases}


def attention_cases(suite: str, size: str) -> list:
    """The :class:`~cupa.bench.cases.Case` list of an attention suite at ``size``."""
    if size not in SIZES:
        raise ValueError(f"size: got {size!r}; expected one of {SIZES}")
    return _BUILDERS[suite](size)
