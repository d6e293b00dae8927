"""Peers: other attention implementations timed in the same process, on the same inputs, with the same
L2 flush as cupa.

Each peer is a small adapter (:class:`Peer`): ``available()`` says whether its library imports here
(and its version, or why not), ``prepare(built, runtime)`` turns one case's :class:`~cupa.bench.cases.Built`
inputs into a :class:`Prepared` call -- all planning, index building and layout work done there, outside
the timed region, as the library's users run it -- or raises :class:`Unsupported` naming what the
library cannot express. A peer that does not import is reported as missing for every case it would
have run, never left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import ml_dtypes
import numpy as np

__all__ = ["Peer", "Prepared", "Unsupported", "all_peers", "to_torch", "host_float32"]


class Unsupported(Exception):
    """The peer cannot run this case (a feature its API does not have); the message says which."""


@dataclass
class Prepared:
    """One case made ready for a peer.

    Attributes
    ----------
    fn : callable
        The timed call (no host synchronization, enqueued on the run's stream).
    output : callable
        Returns the last ``fn()`` result as an (N, H * v_head_size) array (any library), to check it
        against cupa's output.
    note : str
        How the peer ran the case (for example "K/V expanded to every query head").
    """

    fn: Callable[[], Any]
    output: Callable[[], Any]
    note: str = ""


class Peer:
    """An adapter for one peer library (subclasses set ``name``, ``description`` and ``suites``)."""

    name = "peer"
    description = ""
    #: suites whose cases the peer is asked to run
    suites: tuple = ()
    _availability: Optional[tuple] = None

    def available(self) -> tuple:
        """``(True, version)`` or ``(False, why not)``; computed once."""
        if self._availability is None:
            try:
                self._availability = (True, self._probe())
            except Exception as exc:  # ImportError, no CUDA build, an incompatible wheel
                self._availability = (False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return self._availability

    def _probe(self) -> str:
        raise NotImplementedError

    def prepare(self, built, runtime) -> Prepared:
        raise NotImplementedError


def to_torch(x):
    """A zero-copy torch view of a NumPy or DLPack (CuPy) array; bfloat16 through an int16 view, e4m3
    bytes stay uint8 (callers reinterpret them as ``torch.float8_e4m3fn``)."""
    import torch

    dt = np.dtype(x.dtype)
    if dt == np.dtype(ml_dtypes.bfloat16):
        return to_torch(x.view(np.int16)).view(torch.bfloat16)
    if dt == np.dtype(ml_dtypes.float8_e4m3fn):
        return to_torch(x.view(np.uint8)).view(torch.float8_e4m3fn)
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    return torch.from_dlpack(x)


def host_float32(x) -> np.ndarray:
    """A float32 NumPy copy of a NumPy, CuPy or torch array (bfloat16 included)."""
    if hasattr(x, "detach"):                                    # torch
        return x.detach().float().cpu().numpy()
    if isinstance(x, np.ndarray):
        return x.astype(np.float32)
    import cupy

    dt = np.dtype(x.dtype)
    if dt == np.dtype(ml_dtypes.bfloat16):
        return cupy.asnumpy(x.view(cupy.int16)).view(ml_dtypes.bfloat16).astype(np.float32)
    return cupy.asnumpy(x).astype(np.float32)


def torch_dtype(name: str):
    import torch

    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def all_peers() -> list:
    """Every peer adapter, in the order of the tables' columns."""
    from .flash_attn import FlashAttn2, FlashAttn3
    from .flashinfer import FlashInfer
    from .onnxruntime import OnnxRuntimeCuda
    from .sdpa import TorchSdpa

    return [TorchSdpa("FLASH_ATTENTION"), TorchSdpa("CUDNN_ATTENTION"), FlashInfer(), OnnxRuntimeCuda(),
            FlashAttn2(), FlashAttn3()]
