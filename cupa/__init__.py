"""cupa: paged-KV attention with ONNX Runtime ``com.microsoft::PagedAttention`` semantics.

NumPy inputs run a float64 NumPy reference on the CPU; CuPy arrays and CUDA arrays exposing
``__dlpack__`` (PyTorch, JAX) run CUDA kernels compiled at run time by ``cupy.RawModule``.
"""

from .api import PagedAttention, paged_attention
from .cascade import CascadeAttention, cascade_attention
from .contract import Attributes, Problem
from .errors import PagedAttentionError
from .helpers import compute_scale, dequantize, pack_codes, quantize, rope_cache, unpack_codes
from .options import Options
from .states import merge_states

__version__ = "0.1.0"

__all__ = [
    "paged_attention", "PagedAttention", "PagedAttentionError", "CascadeAttention", "cascade_attention", "Options",
    "Attributes", "Problem", "rope_cache", "compute_scale", "quantize", "dequantize", "pack_codes", "unpack_codes",
    "merge_states", "capture_graph",
    "CapturedGraph", "GraphCaptureError", "serving", "__version__",
]


def __getattr__(name):
    # The graph helper imports CuPy; keep `import cupa` free of it.
    if name in ("capture_graph", "CapturedGraph", "GraphCaptureError"):
        from . import graphs

        return getattr(graphs, name)
    if name == "serving":
        import importlib

        return importlib.import_module(".serving", __name__)
    raise AttributeError(f"module 'cupa' has no attribute {name!r}")
