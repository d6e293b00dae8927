"""FlashInfer's paged wrappers on cupa's own cache (no copy: FlashInfer's ``NHD`` layout is cupa's
``(num_blocks, block_size, Hk, D)``).

The page table is cupa's block table in FlashInfer's form (:func:`~cupa.bench.cases.page_indices`):
``indptr``, ``indices``, ``last_page_len``. ``plan()`` runs once per case outside the timed region, as
FlashInfer's users run it; the timed call is ``run()`` into a preallocated output.

- one new token per sequence: ``BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
  use_tensor_cores=True)``, ``plan(indptr, indices, last_page_len, H, Hk, D, block_size,
  window_left=W-1, q_data_type, kv_data_type, sm_scale)``, ``run(q (B, H, D), (k_cache, v_cache),
  k_scale, v_scale, out)``;
- several new tokens (prefill, chunked prefill, mixed batches): ``BatchPrefillWithPagedKVCacheWrapper(
  workspace, "NHD")``, ``plan(qo_indptr, indptr, indices, last_page_len, H, Hk, D, block_size,
  causal=True, window_left, sm_scale, q_data_type, kv_data_type)``, ``run(q (N, H, D), caches, out)``
  (FlashInfer's causal mask is aligned to the end of the KV sequence, like cupa's);
- head_sink: ``BatchAttentionWithAttentionSinkWrapper`` (the prefill wrapper with a float32 sink per
  head), ``run(q, caches, sink, sm_scale)``;
- LATENT: ``BatchMLAPagedAttentionWrapper(workspace)``, ``plan(qo_indptr, kv_indptr, kv_indices,
  kv_lens, H, v_head_size, head_size - v_head_size, block_size, causal, sm_scale, q dtype, kv dtype)``,
  ``run(q_nope, q_pe, ckv_cache, kpe_cache, out)`` with q and the cache split into their latent and
  RoPE channels as strided views of cupa's arrays.

FlashInfer scales an fp8 cache by one scalar per tensor: fp8 PER_TENSOR cases run with
``k_scale``/``v_scale`` floats; int8 and PER_CHANNEL caches are unsupported.
"""

from __future__ import annotations

import numpy as np

from . import Peer, Prepared, Unsupported, to_torch, torch_dtype
from ..cases import page_indices

__all__ = ["FlashInfer", "WORKSPACE_BYTES"]

#: FlashInfer's recommended float workspace (zeroed before first use).
WORKSPACE_BYTES = 128 << 20


class FlashInfer(Peer):
    name = "flashinfer"
    description = "FlashInfer paged wrappers (plan outside the timed region)"
    suites = ("decode", "prefill", "chunked", "mixed", "mla")

    def __init__(self):
        self._workspace = None

    def _probe(self) -> str:
        import torch

        import flashinfer

        if not torch.cuda.is_available():
            raise RuntimeError("torch has no CUDA device")
        return getattr(flashinfer, "__version__", "unknown")

    def workspace(self):
        import torch

        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        return self._workspace

    def check(self, case) -> None:
        if case.dtype not in ("float16", "bfloat16"):
            raise Unsupported(f"T={case.dtype}")
        if case.quantized:
            if case.cache != "fp8" or case.latent:
                raise Unsupported(f"{case.cache} cache (FlashInfer's quantized paged KV is fp8)")
            if case.quant != "PER_TENSOR":
                raise Unsupported("per-channel cache scales (FlashInfer takes one scale per tensor)")
        if case.latent and case.sinks:
            raise Unsupported("head_sink with MLA")
        if case.latent and case.window > 0:
            raise Unsupported("sliding window with MLA")

    def prepare(self, built, runtime) -> Prepared:
        import torch

        import flashinfer

        case = built.case
        self.check(case)
        x = built.inputs
        B, N = case.batch_size, case.token_count
        H, Hk, D = case.num_heads, case.kv_num_heads, case.head_size
        qdt = torch_dtype(case.dtype)
        kvdt = torch.float8_e4m3fn if case.cache == "fp8" else qdt
        kc = to_torch(x["key_cache"])
        if case.cache == "fp8":
            kc = kc.view(torch.float8_e4m3fn)
        indptr, indices, last = page_indices(built.block_table, built.kv_lens, case.block_size)
        indptr_t, indices_t, last_t = (torch.from_numpy(a) for a in (indptr, indices, last))
        qo_indptr = torch.from_numpy(built.cu_seqlens)
        window_left = case.window - 1 if case.window > 0 else -1
        causal = bool(case.is_causal) and int(built.q_lens.max()) > 1
        sm_scale = case.softmax_scale
        workspace = self.workspace()
        q = to_torch(x["query"])

        if case.latent:
            dv = case.out_head_size
            rope = D - dv
            lat = kc.view(kc.shape[0], kc.shape[1], D)
            q3 = q.view(N, H, D)
            out = torch.empty(N, H, dv, dtype=qdt, device=q.device)
            wrapper = flashinfer.BatchMLAPagedAttentionWrapper(workspace)
            wrapper.plan(qo_indptr, indptr_t, indices_t, torch.from_numpy(built.kv_lens.astype(np.int32)), H, dv,
                         rope, case.block_size, causal, sm_scale, qdt, kvdt)
            args = (q3[..., :dv], q3[..., dv:], lat[..., :dv], lat[..., dv:])
            return _prepared(lambda: wrapper.run(*args, out=out), N, H * dv, "MLA wrapper")

        vc = to_torch(x["value_cache"])
        if case.cache == "fp8":
            vc = vc.view(torch.float8_e4m3fn)
        scales = {}
        if case.cache == "fp8":
            scales = {"k_scale": float(runtime.to_host(x["k_scale"])[0]),
                      "v_scale": float(runtime.to_host(x["v_scale"])[0])}
        q3 = q.view(N, H, D)
        out = torch.empty(N, H, D, dtype=qdt, device=q.device)
        if case.sinks:
            sink = to_torch(x["head_sink"]).float()
            wrapper = flashinfer.BatchAttentionWithAttentionSinkWrapper(
                workspace, kv_layout="NHD", q_data_type=qdt, kv_data_type=kvdt, head_dim_qk=D, head_dim_vo=D,
                window_left=window_left)
            wrapper.plan(qo_indptr, indptr_t, indices_t, last_t, H, Hk, D, case.block_size, causal=causal,
                         window_left=window_left, q_data_type=qdt, kv_data_type=kvdt)
            return _prepared(lambda: wrapper.run(q3, (kc, vc), sink, sm_scale, out=out, **scales), N, H * D,
                             "attention-sink wrapper")
        if int(built.q_lens.max()) == 1 and int(built.q_lens.min()) == 1:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
            wrapper.plan(indptr_t, indices_t, last_t, H, Hk, D, case.block_size, window_left=window_left,
                         q_data_type=qdt, kv_data_type=kvdt, sm_scale=sm_scale)
            return _prepared(lambda: wrapper.run(q3, (kc, vc), out=out, **scales), N, H * D,
                             "decode wrapper, tensor cores")
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(qo_indptr, indptr_t, indices_t, last_t, H, Hk, D, case.block_size, causal=causal,
                     window_left=window_left, sm_scale=sm_scale, q_data_type=qdt, kv_data_type=kvdt)
        return _prepared(lambda: wrapper.run(q3, (kc, vc), out=out, **scales), N, H * D, "prefill wrapper")


def _prepared(run, rows: int, width: int, note: str) -> Prepared:
    """The timed ``run()`` keeping what it returns (FlashInfer returns its output) for the check."""
    result = {}

    def call():
        result["o"] = run()

    return Prepared(call, lambda: result["o"].reshape(rows, width), note)
