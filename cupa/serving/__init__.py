"""The serving toolkit: a paged KV cache of many layers, a block pool, and the op inputs of every step.

Pure Python and NumPy on the host; the caches and the step arrays live on the caller's library and
device (NumPy, CuPy or PyTorch). The toolkit builds what ``cupa.paged_attention`` takes and never
calls anything else of cupa.

* :class:`KVCache` -- key/value caches of every layer, a cache dtype of :data:`CACHE_DTYPES`,
  a block count from a byte budget or a fraction of the device's free memory.
* :class:`LayerKind` -- full attention, or a sliding window that keeps, rings or evicts its blocks
  (seed 9.3); layers of one model are grouped over one pool (:func:`group_layers`).
* :class:`BlockPool` -- reference-counted blocks, a free list, an LRU prefix cache.
* :class:`KVCacheManager` -- sequences (add, append, append_decode, rollback, fork, finish,
  preempt) and :meth:`KVCacheManager.build_step`, which returns a :class:`Step`: the op's
  cumulative_sequence_length, past_seqlens, block_table, slot_mapping, query_positions and
  attention_metadata, in fixed-capacity buffers for CUDA-graph replay when asked.

See docs/serving.md for how these map onto vLLM and SGLang names. :func:`benchmark_cases` gives the
host benchmark steps to ``python -m cupa.bench`` (suite ``serving``).
"""

from .benchmark import benchmark_cases
from .cache import CACHE_DTYPES, CacheDType, KVCache
from .layers import LayerGroup, LayerKind, full_attention, group_layers, sliding_window
from .manager import KVCacheManager
from .pool import BlockPool
from .prefix import builtin_block_hash, sha256_block_hash
from .step import Step

__all__ = [
    "KVCache", "CacheDType", "CACHE_DTYPES", "LayerKind", "LayerGroup", "full_attention", "sliding_window",
    "group_layers", "BlockPool", "KVCacheManager", "Step", "builtin_block_hash", "sha256_block_hash",
    "benchmark_cases",
]
