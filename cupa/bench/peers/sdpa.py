"""torch ``scaled_dot_product_attention`` on a dense cache, one SDPA backend pinned per peer.

The paged cache is gathered into dense (B, Hk, kv_len, D) tensors before timing (what a server
without paged attention keeps), the query laid out (B, H, q_len, D). The timed call is
``F.scaled_dot_product_attention`` under ``sdpa_kernel([backend])``: GQA through ``enable_gqa=True``,
or -- when the pinned backend refuses it -- with K/V expanded to every query head (the note says
which). Causal masks: none for one query token; ``is_causal=True`` without a past; the bottom-right
``causal_lower_right`` bias with one. A window is served for decode only (the last W keys sliced
out of the dense cache). Ragged batches, sinks, quantized caches and LATENT have no dense SDPA
equivalent and are unsupported.
"""

from __future__ import annotations

import warnings

from . import Peer, Prepared, Unsupported, to_torch
from ..cases import dense_kv, raw_bits

__all__ = ["TorchSdpa", "dense_inputs"]


def dense_inputs(built, xp):
    """``(q, k, v)`` dense arrays on ``xp`` for a uniform case: q (B, H, q_len, D); k, v (B, Hk, keys, D),
    the last ``keys`` = min(kv_len, window) positions for a windowed decode, else all kv_len."""
    case = built.case
    B, H, D = case.batch_size, case.num_heads, case.head_size
    q_len, kv_len = int(built.q_lens[0]), int(built.kv_lens[0])
    query = built.inputs["query"]
    q = xp.ascontiguousarray(raw_bits(query).reshape(B, q_len, H, D).transpose(0, 2, 1, 3)).view(query.dtype)
    k = dense_kv(built.inputs["key_cache"], built.block_table, kv_len, case.block_size, xp)
    v = dense_kv(built.inputs["value_cache"], built.block_table, kv_len, case.block_size, xp)
    if case.window > 0 and kv_len > case.window:
        k = xp.ascontiguousarray(raw_bits(k)[:, :, kv_len - case.window:]).view(k.dtype)
        v = xp.ascontiguousarray(raw_bits(v)[:, :, kv_len - case.window:]).view(v.dtype)
    return q, k, v


class TorchSdpa(Peer):
    """``torch.nn.functional.scaled_dot_product_attention`` with one backend pinned.

    Parameters
    ----------
    backend : str or None
        A ``torch.nn.attention.SDPBackend`` name ("FLASH_ATTENTION", "CUDNN_ATTENTION", ...); None
        lets torch choose (the CPU tests use that).
    """

    suites = ("decode", "prefill", "chunked")

    def __init__(self, backend: str | None = "FLASH_ATTENTION"):
        self.backend = backend
        short = {"FLASH_ATTENTION": "flash", "CUDNN_ATTENTION": "cudnn", "EFFICIENT_ATTENTION": "efficient",
                 "MATH": "math", None: "default"}.get(backend, (backend or "").lower())
        self.name = f"torch_sdpa_{short}"
        self.description = f"torch SDPA ({short} backend) on a dense cache"

    def _probe(self) -> str:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401

        if self.backend is not None:
            if not torch.cuda.is_available():
                raise RuntimeError("torch has no CUDA device")
            getattr(SDPBackend, self.backend)
        return torch.__version__

    def check(self, case) -> None:
        """Raise :class:`Unsupported` for a case dense SDPA cannot express."""
        if case.latent:
            raise Unsupported("LATENT (MLA) layout")
        if case.quantized:
            raise Unsupported("quantized cache (dense SDPA takes T)")
        if case.sinks:
            raise Unsupported("head_sink (no sink logit in SDPA)")
        if not case.uniform:
            raise Unsupported("ragged lengths (a dense batch needs equal lengths)")
        if case.window > 0 and case.q_lens[0] != 1:
            raise Unsupported("sliding window with several query tokens (needs an explicit mask)")

    def prepare(self, built, runtime) -> Prepared:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        case = built.case
        self.check(case)
        q, k, v = (to_torch(a) for a in dense_inputs(built, runtime.xp))
        q_len, past = int(built.q_lens[0]), int(built.past[0])
        mask, is_causal = None, False
        if q_len > 1 and past == 0:
            is_causal = True
        elif q_len > 1:
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(q_len, k.shape[2])
        backends = [getattr(SDPBackend, self.backend)] if self.backend else None
        scale = case.softmax_scale
        B, H, D = case.batch_size, case.num_heads, case.head_size
        result = {}

        def call(qt, kt, vt, gqa):
            if backends is None:
                result["o"] = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=is_causal,
                                                             scale=scale, enable_gqa=gqa)
                return
            with sdpa_kernel(backends):
                result["o"] = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=is_causal,
                                                             scale=scale, enable_gqa=gqa)

        note = "enable_gqa" if H != case.kv_num_heads else ""
        try:
            with warnings.catch_warnings():     # a pinned backend that refuses the inputs warns, then raises
                warnings.simplefilter("ignore")
                call(q, k, v, H != case.kv_num_heads)
            fn = lambda: call(q, k, v, H != case.kv_num_heads)  # noqa: E731
        except (RuntimeError, TypeError, NotImplementedError, ValueError):
            if H == case.kv_num_heads:
                raise
            group = H // case.kv_num_heads
            ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            call(q, ke, ve, False)
            fn = lambda: call(q, ke, ve, False)  # noqa: E731
            note = "K/V expanded to every query head (the backend refused enable_gqa)"
        if mask is not None:
            note = ", ".join(x for x in (note, "causal_lower_right") if x)

        def output():
            return result["o"].transpose(1, 2).reshape(B * q_len, H * D)

        return Prepared(fn, output, note)
