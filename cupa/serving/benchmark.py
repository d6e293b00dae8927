"""Host benchmark scenarios of the serving toolkit.

:class:`Scenario` is a running batch: ``seqs - 1`` decoding sequences with contexts drawn up to
``max_context`` and one sequence prefilling ``chunk`` tokens per step (a new prompt when it is
done). ``benchmarks/bench_serving_host.py`` times its pieces (``append_decode``, ``append``,
``build_step``); :func:`benchmark_cases` gives whole steps and pool operations to the ``serving``
suite of ``python -m cupa.bench``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .cache import KVCache
from .layers import LayerKind, full_attention, sliding_window
from .manager import KVCacheManager
from .pool import BlockPool

__all__ = ["Scenario", "benchmark_cases", "CASES"]

#: name -> (layer kinds, prefix caching)
CASES = {
    "full attention": ([full_attention()], False),
    "full attention, prefix caching": ([full_attention()], True),
    "GPT-OSS groups (full + window 128 evict)": ([full_attention(), sliding_window(128, "evict")], False),
    "GPT-OSS groups, prefix caching": ([full_attention(), sliding_window(128, "evict")], True),
}
#: size -> (running sequences, max context, prefill chunk, steps of headroom)
SIZES = {"full": (256, 32768, 512, 16384), "quick": (256, 32768, 512, 2048), "smoke": (8, 1024, 64, 64)}


class Scenario:
    """``seqs - 1`` decoding sequences and one chunked prefill over one :class:`KVCacheManager`.

    The decoders start at random contexts up to ``max_context`` and grow by one token a step;
    ``steps`` steps fit (the model length is ``max_context + steps``). The layers keep a head
    size of 8: the host work does not depend on it.
    """

    def __init__(self, kinds: Sequence[LayerKind], *, seqs: int = 256, block_size: int = 16,
                 max_context: int = 32768, chunk: int = 512, steps: int = 4096, prefix: bool = False,
                 seed: int = 0):
        rng = np.random.default_rng(seed)
        lengths = rng.integers(max_context // 64, max_context, seqs - 1)
        need = int(lengths.sum() + (seqs - 1) * steps + 2 * max_context) // block_size + 4 * seqs
        self.cache = KVCache(list(kinds), kv_num_heads=1, head_size=8, dtype="float16", block_size=block_size,
                             num_blocks=need * len(kinds))
        self.manager = m = KVCacheManager(self.cache, max_num_seqs=seqs, max_model_len=max_context + steps,
                                          max_num_batched_tokens=max_context, enable_prefix_caching=prefix)
        self.prefix, self.chunk, self.max_context = prefix, chunk, max_context
        for i, n in enumerate(lengths.tolist()):
            m.add(i)
            m.append(i, rng.integers(0, 32000, n) if prefix else n)
            m.build_step()
        m.add("prefill")
        self.decoding = np.ones(seqs, dtype=bool)         # the row mask of append_decode: all but the prefill
        self.decoding[m.seq_ids.index("prefill")] = False
        self.tokens = rng.integers(0, 32000, seqs - 1)
        self.prompt = rng.integers(0, 32000, max_context - 1)
        self.sent = 0

    def decode(self) -> None:
        self.manager.append_decode(self.tokens, self.decoding)

    def prefill(self) -> None:
        m = self.manager
        if self.sent + self.chunk > len(self.prompt):     # the prompt is done: a new one takes the same row
            m.finish("prefill")
            m.add("prefill")
            self.sent = 0
        piece = self.prompt[self.sent:self.sent + self.chunk]
        m.append("prefill", piece if self.prefix else len(piece))
        self.sent += self.chunk

    def build(self):
        return self.manager.build_step()

    def step(self):
        self.decode()
        self.prefill()
        return self.build()


def benchmark_cases(size: str = "full", cases: Optional[Sequence[str]] = None) -> list:
    """``(name, fn, params)`` for the ``serving`` suite of ``python -m cupa.bench``.

    One step of each :data:`CASES` scenario (``append_decode`` + ``append`` of a prefill chunk +
    ``build_step``), and one pool operation (``allocate_one`` + ``free`` on a half-full pool).
    ``size``: "full", "quick" or "smoke" (8 sequences of up to 1k tokens).
    """
    seqs, max_context, chunk, steps = SIZES[size]
    out = []
    for name in cases or CASES:
        kinds, prefix = CASES[name]
        sc = Scenario(kinds, seqs=seqs, max_context=max_context, chunk=chunk, steps=steps, prefix=prefix)
        out.append((f"step: {name}", sc.step, dict(running=seqs, max_context=max_context, chunk=chunk,
                                                  block_size=16, prefix_caching=prefix)))
    pool = BlockPool(1 << 16)
    pool.allocate(1 << 15)
    out.append(("pool: allocate_one + free", lambda: pool.free([pool.allocate_one()]), dict(num_blocks=1 << 16)))
    return out
