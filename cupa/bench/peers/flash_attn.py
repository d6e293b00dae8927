"""flash-attn's paged ``flash_attn_with_kvcache``: FlashAttention-2 (package ``flash_attn``) and
FlashAttention-3 (``flash_attn_interface``, the Hopper build), on cupa's own cache.

Both take the new tokens' K/V and append them to the paged cache inside the call, as cupa's prologue
does: ``cache_seqlens`` is each sequence's past, ``k``/``v`` the new rows, the block table cupa's own
(unmapped entries -1 replaced by block 0: flash-attn reads table entries past a sequence's end).
Causal masks are bottom-right aligned, like cupa's; a window W is ``window_size=(W-1, 0)``.

- FlashAttention-2: ``flash_attn_with_kvcache(q (B, S, H, D), k_cache, v_cache, k=(B, S, Hk, D), v,
  cache_seqlens=past, block_table, softmax_scale, causal, window_size)``; paged caches need
  ``block_size % 256 == 0`` and every sequence the same number S of new tokens.
- FlashAttention-3: the same call with ``page_table=`` (any block size); ragged new-token counts go as
  ``q (N, H, D)``, ``k``/``v (N, Hk, D)`` with ``cu_seqlens_q``, ``cu_seqlens_k_new`` and ``max_seqlen_q``.

Neither has sinks, quantized (e4m3 with fp16/bf16 Q) or latent caches.
"""

from __future__ import annotations

import numpy as np

from . import Peer, Prepared, Unsupported, to_torch

__all__ = ["FlashAttn2", "FlashAttn3", "kvcache_arguments"]


def kvcache_arguments(built, xp, page_key: str = "block_table", varlen: bool = False) -> dict:
    """The keyword arguments of ``flash_attn_with_kvcache`` for a case, as ``xp`` arrays (tests build
    them with NumPy): uniform cases in the (B, S, heads, D) layout, ``varlen`` ones packed (N, heads, D)."""
    case = built.case
    x = built.inputs
    B, N, S = case.batch_size, case.token_count, int(built.q_lens[0])
    H, Hk, D = case.num_heads, case.kv_num_heads, case.head_size
    table = built.block_table.copy()
    table[table < 0] = 0
    args = {page_key: xp.asarray(table), "cache_seqlens": xp.asarray(built.past.astype(np.int32)),
            "softmax_scale": case.softmax_scale, "causal": bool(case.is_causal),
            "window_size": (case.window - 1, 0) if case.window > 0 else (-1, -1)}
    if varlen:
        args.update(q=x["query"].reshape(N, H, D), k=x["key"].reshape(N, Hk, D), v=x["value"].reshape(N, Hk, D),
                    cu_seqlens_q=xp.asarray(built.cu_seqlens), cu_seqlens_k_new=xp.asarray(built.cu_seqlens),
                    max_seqlen_q=int(built.q_lens.max()))
    else:
        args.update(q=x["query"].reshape(B, S, H, D), k=x["key"].reshape(B, S, Hk, D),
                    v=x["value"].reshape(B, S, Hk, D))
    args.update(k_cache=x["key_cache"], v_cache=x["value_cache"])
    return args


class _FlashAttn(Peer):
    suites = ("decode", "prefill", "chunked", "mixed")
    module = ""
    page_key = "block_table"

    def _probe(self) -> str:
        import importlib

        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch has no CUDA device")
        mod = importlib.import_module(self.module)
        self._fn = mod.flash_attn_with_kvcache
        return str(getattr(mod, "__version__", None) or _dist_version(self.module))

    def check(self, case) -> None:
        if case.latent:
            raise Unsupported("LATENT (MLA) layout")
        if case.quantized:
            raise Unsupported(f"{case.cache} cache")
        if case.sinks:
            raise Unsupported("head_sink")
        if case.dtype not in ("float16", "bfloat16"):
            raise Unsupported(f"T={case.dtype}")

    def varlen(self, case) -> bool:
        return len(set(case.q_lens)) != 1

    def prepare(self, built, runtime) -> Prepared:
        case = built.case
        self.check(case)
        self.available()
        varlen = self.varlen(case)
        args = {k: (to_torch(v) if hasattr(v, "dtype") and hasattr(v, "shape") else v)
                for k, v in kvcache_arguments(built, runtime.xp, self.page_key, varlen).items()}
        fn = self._fn
        N, H, D = case.token_count, case.num_heads, case.head_size
        result = {}

        def call():
            result["o"] = fn(**args)

        return Prepared(call, lambda: result["o"].reshape(N, H * D), "varlen (cu_seqlens_q)" if varlen else "")


class FlashAttn2(_FlashAttn):
    name = "flash_attn2"
    description = "FlashAttention-2 flash_attn_with_kvcache (paged, appends K/V)"
    module = "flash_attn"

    def check(self, case) -> None:
        super().check(case)
        if case.block_size % 256:
            raise Unsupported(f"block_size {case.block_size} (FlashAttention-2's paged cache needs a multiple of 256)")
        if self.varlen(case):
            raise Unsupported("ragged new-token counts (the (B, S, H, D) layout needs one S)")


class FlashAttn3(_FlashAttn):
    name = "flash_attn3"
    description = "FlashAttention-3 flash_attn_with_kvcache (paged, appends K/V)"
    module = "flash_attn_interface"
    page_key = "page_table"


def _dist_version(module: str) -> str:
    from ..runtime import package_version

    for dist in {"flash_attn": ("flash-attn", "flash_attn"),
                 "flash_attn_interface": ("flash-attn-3", "flash_attn_3", "flashattn-hopper")}[module]:
        v = package_version(dist)
        if v:
            return v
    return "unknown"
