"""cupa's benchmark command, ``python -m cupa.bench``: every suite and every peer in one run.

Suites (:mod:`cupa.bench.sweeps` lists their cases): decode, prefill, chunked prefill, mixed
prefill + decode batches, MLA, sub-byte caches, cascade, the general backend (attention_bias,
output_qk), CUDA graphs, host overhead and the serving toolkit's host step. Peers (:mod:`cupa.bench.peers`): torch SDPA on a dense cache (flash and cuDNN
backends), FlashInfer's paged wrappers, ONNX Runtime's CUDA ``com.microsoft::PagedAttention`` and
flash-attn's paged ``flash_attn_with_kvcache`` (FlashAttention-2 and -3), each timed in the same
process on the same inputs with the same L2 flush (:mod:`cupa.bench.timing`), beside a read probe and
a dense GEMM measured in the same run. Results: JSON, a markdown table and PNG plots
(:mod:`cupa.bench.report`, :mod:`cupa.bench.plots`). ``--smoke`` runs tiny shapes on the NumPy
reference backend, without peers, on any machine.

    python -m cupa.bench --out results.json            # everything (a CUDA device)
    python -m cupa.bench --quick --only decode,prefill
    python -m cupa.bench --compare old.json --out new.json
    python -m cupa.bench --smoke --out /tmp/smoke.json  # CPU
"""

from .cli import main
from .timing import CpuTimer, ReadProbe, Timer

__all__ = ["main", "Timer", "CpuTimer", "ReadProbe"]
