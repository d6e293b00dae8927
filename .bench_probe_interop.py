import os
from cupa import jit
s = jit.Specialization("jit_smoke", "smoke_scale<float, 256>")
r = jit.compile_offline(s, "sm_90", source_dir="tests/data"); print("before", r.ok, len(r.log))
os.environ["CUDA_CACHE_DISABLE"] = "1"
r = jit.compile_offline(s, "sm_90", source_dir="tests/data"); print("after set", r.ok, len(r.log))
del os.environ["CUDA_CACHE_DISABLE"]
r = jit.compile_offline(s, "sm_90", source_dir="tests/data"); print("after del", r.ok, len(r.log))
