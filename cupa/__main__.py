"""Command line: ``python -m cupa demo`` and ``python -m cupa info`` (also the ``cupa`` script).

``demo`` runs a paged prefill and a few decode steps of a small Llama-shaped problem (GQA, RoPE,
ragged sequences, a shuffled block table) and checks every output and every cache write against a
dense float64 attention computed here, independently of cupa's backends. It runs on the GPU when
CuPy sees a device and a CUDA backend imports, else on the NumPy reference backend. Exit status:
0 PASS, 1 FAIL, 2 the requested backend is unavailable.

``info`` prints the versions and devices a bug report needs.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import secrets
import sys
import time
from dataclasses import dataclass
from importlib import metadata

import ml_dtypes
import numpy as np

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
from cupa.contract import TOLERANCE  # noqa: E402  (the relative-error bound per T, contract §6)


# -- info ---------------------------------------------------------------------------------------

def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10} ({v})"


def kernel_cache_dir() -> str:
    """Where CuPy keeps compiled kernels (cupa's RawModules included)."""
    return os.environ.get("CUPY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache")


def info_lines() -> list:
    import cupa

    rows = [
        ("cupa", f"{cupa.__version__} ({os.path.dirname(os.path.abspath(cupa.__file__))})"),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("platform", platform.platform()),
        ("numpy", np.__version__),
        ("ml_dtypes", _version("ml_dtypes")),
    ]
    try:
        import cupy
    except Exception as exc:  # not installed, or a broken install
        cupy = None
        installed = [d for d in ("cupy-cuda13x", "cupy-cuda12x", "cupy") if _version(d) != "not installed"]
        rows.append(("cupy", f"import failed: {exc}" if installed else "not installed"))
    if cupy is not None:
        rows.append(("cupy", f"{cupy.__version__} ({_installed_cupy_dist()})"))
        from cupy.cuda import nvrtc, runtime

        for label, query in (("CUDA runtime", runtime.runtimeGetVersion),
                             ("CUDA driver", runtime.driverGetVersion)):
            try:
                v = query()
                rows.append((label, _cuda_version(v) if v else "none (no driver)"))
            except Exception as exc:
                rows.append((label, f"not available ({_short(exc)})"))
        try:
            rows.append(("NVRTC", ".".join(str(x) for x in nvrtc.getVersion())))
        except Exception as exc:
            rows.append(("NVRTC", f"not available ({_short(exc)})"))
        try:
            count = runtime.getDeviceCount()
        except Exception as exc:
            count = 0
            rows.append(("devices", f"none seen ({_short(exc)})"))
        else:
            rows.append(("devices", str(count) if count else "none seen"))
        for i in range(count):
            try:
                props = runtime.getDeviceProperties(i)
                name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
                mem = props["totalGlobalMem"] / 2**30
                rows.append((f"  [{i}]", f"{name}, compute capability {props['major']}.{props['minor']}, "
                                         f"{mem:.0f} GiB"))
            except Exception as exc:
                rows.append((f"  [{i}]", f"unreadable ({_short(exc)})"))
    rows.append(("CUDA backends", _cuda_backend_names(cupy is not None and _usable_devices(cupy))))
    try:
        from cupa import jit

        rows.append(("CUDA headers", jit.cuda_include_dirs()[0] + " (for kernels pinned to sm_90a)"))
    except Exception as exc:
        rows.append(("CUDA headers", f"not found ({_short(exc)})"))
    rows.append(("kernel cache", kernel_cache_dir()))
    width = max(len(k) for k, _ in rows)
    return [f"{k:<{width}}  {v}" for k, v in rows]


def _installed_cupy_dist() -> str:
    found = [d for d in ("cupy-cuda13x", "cupy-cuda12x", "cupy") if _version(d) != "not installed"]
    return ", ".join(found) or "source build"


def _usable_devices(cupy) -> bool:
    try:
        return bool(cupy.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:  # no driver
        return False


def _cuda_backend_names(usable: bool) -> str:
    try:
        from cupa import dispatch

        backends = dispatch.cuda_backends()
    except Exception as exc:
        return f"unavailable ({_short(exc)})"
    names = ", ".join(b.name + ("" if b.verified else " (not yet verified on a GPU)") for b in backends)
    if not usable:
        return f"none usable here (CuPy and a CUDA device are needed; device inputs would run: {names})"
    return names


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text and text[0] else type(exc).__name__


def cmd_info(args: argparse.Namespace) -> int:
    print("\n".join(info_lines()))
    return 0


# -- demo ---------------------------------------------------------------------------------------

@dataclass
class DemoModel:
    """A Llama-shaped attention layer, small enough for the float64 reference to be instant."""

    num_heads: int = 8
    kv_num_heads: int = 2
    head_size: int = 64
    block_size: int = 16
    rope_base: float = 10000.0
    max_position: int = 256
    dtype: str = "float16"


def _gpu_status() -> tuple:
    """(usable, why not): CuPy sees a device and a CUDA backend imports."""
    try:
        import cupy
    except Exception as exc:
        return False, f"CuPy is not importable ({_short(exc)})"
    try:
        if not cupy.cuda.is_available():
            return False, "CuPy sees no CUDA device"
    except Exception as exc:
        return False, f"CuPy cannot query devices ({_short(exc)})"
    try:
        from cupa import dispatch

        if not dispatch.cuda_backends():
            return False, "no CUDA backend is registered"
    except Exception as exc:
        return False, f"the CUDA backends do not import ({_short(exc)})"
    return True, ""


def rope_tables(model: DemoModel) -> tuple:
    """cos/sin of shape (max_position, head_size/2) for RoPE over the whole head, float64."""
    half = model.head_size // 2
    inv_freq = model.rope_base ** (-np.arange(half, dtype=np.float64) * 2.0 / model.head_size)
    angle = np.arange(model.max_position, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angle), np.sin(angle)


def rotate(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Half-split RoPE (pairs i, i+D/2) of x: (tokens, heads, D), float64."""
    half = x.shape[-1] // 2
    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def rotate_magnitude(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """|x1*cos| + |x2*sin| per output channel of :func:`rotate`: the size of the terms it adds."""
    half = x.shape[-1] // 2
    c = np.abs(cos[positions][:, None, :])
    s = np.abs(sin[positions][:, None, :])
    x1, x2 = np.abs(x[..., :half]), np.abs(x[..., half:])
    return np.concatenate([x1 * c + x2 * s, x2 * c + x1 * s], axis=-1)


def dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray,
                    scale: float) -> np.ndarray:
    """Causal GQA attention of one sequence in float64.

    q: (tokens, H, D) at ``positions``; k, v: (kv_len, Hk, D), the whole history.
    """
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("thd,khd->htk", q, k) * scale
    visible = np.arange(k.shape[0])[None, :] <= positions[:, None]
    scores = np.where(visible[None], scores, -np.inf)
    prob = np.exp(scores - scores.max(axis=-1, keepdims=True))
    prob /= prob.sum(axis=-1, keepdims=True)
    return np.einsum("htk,khd->thd", prob, v)


def _round(x: np.ndarray, dtype) -> np.ndarray:
    return x.astype(dtype).astype(np.float64)


def _ulp(x: np.ndarray, dtype) -> np.ndarray:
    """One unit in the last place of T at |x|, as float64."""
    return np.spacing(np.abs(x).astype(dtype)).astype(np.float64)


def run_demo(prompt_lens=(37, 5, 21), decode_steps: int = 4, backend: str = "auto",
             seed: int | None = None, model: DemoModel | None = None, out=sys.stdout) -> bool | None:
    """Prefill then decode, each step checked against dense attention; prints a report.

    Returns True on PASS, False on FAIL, None when ``backend="cuda"`` was asked for and is unavailable.
    """
    import cupa

    model = model or DemoModel()
    seed = secrets.randbits(31) if seed is None else seed
    rng = np.random.default_rng(seed)
    H, Hk, D, bs = model.num_heads, model.kv_num_heads, model.head_size, model.block_size
    T = np.dtype(DTYPES[model.dtype])
    tol = TOLERANCE[model.dtype]
    say = lambda line="": print(line, file=out)  # noqa: E731

    usable, why_not = _gpu_status()
    if backend == "cuda" and not usable:
        say(f"cupa demo: the CUDA backend was requested but is unavailable: {why_not}")
        return None
    on_gpu = backend == "cuda" or (backend == "auto" and usable)
    if on_gpu:
        import cupy as xp
    else:
        xp = np

    # Paged cache: each sequence owns just enough blocks for its prompt and decode tokens,
    # scattered over a shuffled pool with a few spare blocks, so the block table matters.
    batch = len(prompt_lens)
    final_lens = [n + decode_steps for n in prompt_lens]
    blocks_needed = [math.ceil(n / bs) for n in final_lens]
    num_blocks = sum(blocks_needed) + 3
    pool = rng.permutation(num_blocks)
    block_table = np.full((batch, max(blocks_needed)), -1, dtype=np.int32)
    start = 0
    for b, nb in enumerate(blocks_needed):
        block_table[b, :nb] = pool[start:start + nb]
        start += nb
    cache_shape = (num_blocks, bs, Hk, D)
    key_cache = xp.zeros(cache_shape, dtype=T)
    value_cache = xp.zeros(cache_shape, dtype=T)

    cos, sin = rope_tables(model)
    cos_cache, sin_cache = xp.asarray(cos.astype(T)), xp.asarray(sin.astype(T))
    cos_t, sin_t = _round(cos, T), _round(sin, T)  # what the kernels see
    scale = 1.0 / math.sqrt(D)
    op = cupa.PagedAttention(num_heads=H, kv_num_heads=Hk, do_rotary=1)

    # The demo's own record of each sequence's rotated keys and values (float64 of T values), and
    # how far a written key may be from it: one unit in the last place of T, plus the float32
    # rounding of RoPE on the GPU (which cancellation can make larger than T's ulp for float32).
    history_k = [np.zeros((0, Hk, D)) for _ in range(batch)]
    history_v = [np.zeros((0, Hk, D)) for _ in range(batch)]
    key_tolerance = [np.zeros((0, Hk, D)) for _ in range(batch)]

    say(f"cupa {cupa.__version__} demo: paged prefill + {decode_steps} decode steps, checked against "
        "dense float64 attention")
    say(f"  model      GQA {H} query heads / {Hk} KV heads, head_size {D}, RoPE over {D} channels, {T.name}")
    say(f"  cache      key/value {cache_shape} {T.name}, block_size {bs}, "
        f"block_table {block_table.shape} int32 (shuffled pool of {num_blocks} blocks)")
    say(f"  sequences  {batch}, prompt lengths {list(prompt_lens)}, seed {seed}")

    steps = [("prefill", list(prompt_lens))] + [(f"decode {i + 1}", [1] * batch) for i in range(decode_steps)]
    past = [0] * batch
    worst = 0.0
    cache_ok = True
    backend_name = None
    rows = []
    t0 = time.perf_counter()
    for label, q_lens in steps:
        n = sum(q_lens)
        cum = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        q = (rng.standard_normal((n, H * D)) * 0.5).astype(T)
        k = (rng.standard_normal((n, Hk * D)) * 0.5).astype(T)
        v = rng.standard_normal((n, Hk * D)).astype(T)
        inputs = dict(query=xp.asarray(q), key=xp.asarray(k), value=xp.asarray(v), key_cache=key_cache,
                      value_cache=value_cache, cumulative_sequence_length=xp.asarray(cum),
                      past_seqlens=xp.asarray(np.asarray(past, dtype=np.int32)),
                      block_table=xp.asarray(block_table), cos_cache=cos_cache, sin_cache=sin_cache,
                      attention_metadata=[max(q_lens), max(p + ql for p, ql in zip(past, q_lens))])
        try:
            if backend_name is None:
                plan = op.plan(**inputs)
                backend_name = plan.backend.name + (
                    f": {plan.backend.describe(plan.problem, plan.device, plan.options)}" if on_gpu else "")
            output = op(**inputs)
        except cupa.PagedAttentionError as exc:
            say(f"  {label}: cupa raised PagedAttentionError: {exc}")
            say("result: FAIL")
            return False
        output = np.asarray(output.get() if on_gpu else output, dtype=np.float64).reshape(n, H, D)
        kc = key_cache.get() if on_gpu else key_cache
        vc = value_cache.get() if on_gpu else value_cache

        expected = np.empty((n, H, D))
        step_cache_ok = True
        for b in range(batch):
            rows_b = slice(cum[b], cum[b + 1])
            positions = past[b] + np.arange(q_lens[b])
            q_rot = _round(rotate(q[rows_b].astype(np.float64).reshape(-1, H, D), positions, cos_t, sin_t), T)
            k_new = k[rows_b].astype(np.float64).reshape(-1, Hk, D)
            k_rot = _round(rotate(k_new, positions, cos_t, sin_t), T)
            k_magnitude = rotate_magnitude(k_new, positions, cos_t, sin_t)
            history_k[b] = np.concatenate([history_k[b], k_rot])
            key_tolerance[b] = np.concatenate([key_tolerance[b], _ulp(k_rot, T) + 2.0**-22 * k_magnitude])
            history_v[b] = np.concatenate([history_v[b], v[rows_b].astype(np.float64).reshape(-1, Hk, D)])
            expected[rows_b] = dense_attention(q_rot, history_k[b], history_v[b], positions, scale)
            # Gather this sequence's pages back into a dense history and compare with the record;
            # values are copied, so they must match exactly.
            kv_len = past[b] + q_lens[b]
            slots = block_table[b][np.arange(kv_len) // bs], np.arange(kv_len) % bs
            for got, want, tolerance in ((kc[slots], history_k[b], key_tolerance[b]),
                                         (vc[slots], history_v[b], 0.0)):
                step_cache_ok &= bool(np.all(np.abs(got.astype(np.float64) - want) <= tolerance))
        rel = float(np.linalg.norm(output - expected) / np.linalg.norm(expected))
        max_abs = float(np.max(np.abs(output - expected)))
        worst = max(worst, rel)
        cache_ok &= step_cache_ok
        past = [p + ql for p, ql in zip(past, q_lens)]
        rows.append((label, n, list(past), rel, max_abs, "ok" if step_cache_ok else "MISMATCH"))
    elapsed = time.perf_counter() - t0

    if on_gpu:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        say(f"  device     {name} (CuPy arrays)")
        say(f"  backend    {backend_name}")
    else:
        say(f"  backend    {backend_name} (NumPy arrays, float64 reference on the CPU)")
        if backend == "auto":
            say(f"  note       no GPU run: {why_not}; the same code runs on the GPU with CuPy arrays")
    say()
    say(f"  {'step':<10} {'tokens':>6}  {'kv lengths after':<18} {'rel err':>9} {'max |err|':>10}  cache")
    for label, n, lens, rel, max_abs, cache in rows:
        say(f"  {label:<10} {n:>6}  {str(lens):<18} {rel:>9.2e} {max_abs:>10.2e}  {cache}")
    say()
    passed = worst <= tol and cache_ok
    verdict = "PASS" if passed else "FAIL"
    say(f"result: {verdict} (max rel err {worst:.2e}, bound {tol:.0e} for {T.name}; cache writes "
        f"{'match' if cache_ok else 'DIFFER from the expected K/V'}; {elapsed:.2f} s"
        f"{', including the first GPU call, which compiles or loads the kernels' if on_gpu else ''})")
    return passed


def cmd_demo(args: argparse.Namespace) -> int:
    model = DemoModel(dtype=args.dtype)
    passed = run_demo(decode_steps=args.steps, backend=args.backend, seed=args.seed, model=model)
    if passed is None:
        return 2
    return 0 if passed else 1


# -- entry point --------------------------------------------------------------------------------

def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"got {value}; expected an integer >= 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cupa", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="{demo,info}")
    demo = sub.add_parser("demo", help="prefill + decode on a small model, checked against dense attention",
                          description="Paged prefill followed by decode steps (GQA 8/2 heads, head 64, "
                                      "block 16, 3 ragged sequences, RoPE), checked against dense float64 "
                                      "attention. Exit status 0 PASS, 1 FAIL, 2 backend unavailable.")
    demo.add_argument("--backend", choices=("auto", "cuda", "numpy"), default="auto",
                      help="auto (default): the GPU when usable, else the NumPy reference")
    demo.add_argument("--dtype", choices=tuple(TOLERANCE), default="float16", help="T (default float16)")
    demo.add_argument("--steps", type=_non_negative, default=4, help="decode steps after the prefill (default 4)")
    demo.add_argument("--seed", type=int, default=None, help="random seed (default: fresh, printed)")
    demo.set_defaults(func=cmd_demo)
    info = sub.add_parser("info", help="versions, CUDA runtime/driver, devices, kernel cache dir")
    info.set_defaults(func=cmd_info)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
