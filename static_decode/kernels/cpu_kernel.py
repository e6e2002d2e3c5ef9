"""Our CPU kernels, built on first use, then ops like any others: decode attention (csrc/decode_attention.cpp) and
the bfloat16 one-row products (csrc/gemv_bf16.cpp, where the CPU has AVX512-BF16 or AVX2 (csrc/gemv_avx2.cpp):
`gemv_bf16`, and the calls a decode layer makes in place of several: `gemv_bf16_cat3` for q/k/v, `gemv_bf16_glu` for
SwiGLU's gate/up/silu), and
a batch-1 decode step's whole decoder layers in one call (csrc/decode_layers.cpp, static_decode.model.fused_decode).

They exist because torch's formulations read the cache and the bf16 weights well below the memory's rate at decode
shapes. Registered under `torch.ops.static_decode_cpu` with Meta kernels, so compiled steps call them without a
graph break; every argument is checked before anything is read or written. Built once per machine, torch, Python
and source version under $TORCH_EXTENSIONS_DIR, behind a lock of our own; without a compiler, or with
STATIC_DECODE_CPU_KERNEL=0, `available()` is False and the PyTorch formulations stay. Why and how:
docs/internals.md#cpu-kernel.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")
_SOURCE_NAMES = ("decode_attention.cpp", "decode_attention_int8.cpp", "gemv_bf16.cpp", "gemv_quant.cpp",
                 "gemv_avx2.cpp", "linear_quant.cpp", "decode_layers.cpp", "decode_layers_checks.cpp",
                 "sample_keys.cpp", "gguf_ops.cpp", "gguf_portable.cpp", "gguf_avx2.cpp",
                 "gguf_avx512.cpp")
SOURCES = [CSRC / name for name in _SOURCE_NAMES]
# Hashed into the build flags: torch's builder tracks only the sources.
HEADERS = [CSRC / name for name in ("kernels.h", "checks.h", "attention_avx512.h", "decode_common.h",
                                         "decode_layers.h", "gguf_blocks.h", "attention_avx2.h")]
ENV = "STATIC_DECODE_CPU_KERNEL"  # "0": never build or use the kernels
WAIT_ENV = "STATIC_DECODE_BUILD_WAIT"  # seconds to wait for another process's build (default BUILD_WAIT)
BUILD_WAIT = 1800.0
BUILD_SECONDS = 100  # one build on 2 busy vCPUs (30-50 s idle: profiles/RESULTS.md, "First kernel build")
MAX_ROWS = 64  # query rows per KV head the kernel takes (kMaxRows)
# The head sizes the attention has code for (csrc/checks.h, kHeadDims), where they are whole float vectors of the
# ISA: `head_dims`. Other sizes take another formulation (supports() is False for them).
HEAD_DIMS = (8, 16, 32, 48, 64, 80, 96, 128, 256)
MAX_HEAD_DIM = max(HEAD_DIMS)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # K/V; the queries may be any of them, math in float32
INT8 = torch.int8  # an int8 cache's codes (static_decode.core.kv_quant): `decode_attention_int8`, with their scales

# The flags inductor compiles its own CPU kernels with for each ISA (torch/_inductor/cpu_vec_isa.py), so the
# kernel's at::vec types are the widths torch uses: AVX-512 here, 16 floats a vector.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
_VEC_FLOATS = {"AVX512": 16, "AVX2": 8}

_state: dict[str, bool] = {}
_facts: dict[str, str | bool] = {}  # the CPU's capability, asked once: the eager projections consult it every call


def capability() -> str:
    """The ISA the kernel is built for: torch's own CPU capability when it is one the flags above cover, else the
    portable DEFAULT (at::vec's generic 8-float vectors, compiled without ISA flags)."""
    if "cap" not in _facts:
        cap = torch.backends.cpu.get_cpu_capability()
        _facts["cap"] = cap if cap in _ISA_FLAGS else "DEFAULT"
    return str(_facts["cap"])


capability._dynamo_marked_constant = True  # type: ignore[attr-defined]  # dynamo cannot trace the capability query


def vector_floats() -> int:
    """Floats in one of the kernel's vectors: a supported head_dim is a multiple of it."""
    return _VEC_FLOATS.get(capability(), 8)


def head_dims(cap: str | None = None) -> tuple[int, ...]:
    """The head sizes the attention kernel built for ISA `cap` (default: this CPU's) computes: csrc/checks.h's list,
    the multiples of the ISA's float vector."""
    width = _VEC_FLOATS.get(cap or capability(), 8)
    return tuple(d for d in HEAD_DIMS if d % width == 0)


def bf16_dot() -> bool:
    """Whether this CPU has AVX512-BF16's dot-product instruction (what gemv_bf16 is built with)."""
    if "bf16" not in _facts:
        _facts["bf16"] = capability() == "AVX512" and torch.cpu._is_avx512_bf16_supported()
    return bool(_facts["bf16"])


bf16_dot._dynamo_marked_constant = True  # type: ignore[attr-defined]


def int8_dot() -> bool:
    """Whether this CPU has AVX512-VNNI's int8 dot product: int8 weights then multiply a bfloat16 row's int8 codes
    (csrc/gemv_quant.cpp, int8_dot_path; `row_codes8` states the quantization)."""
    if "vnni" not in _facts:
        _facts["vnni"] = capability() == "AVX512" and torch.cpu._is_vnni_supported()
    return bool(_facts["vnni"])


int8_dot._dynamo_marked_constant = True  # type: ignore[attr-defined]


def bf16_rows() -> bool:
    """Whether the kernel multiplies bfloat16 weights (gemv_bf16 and the fused layers of a bfloat16 model): with
    AVX512-BF16's dot product, or AVX2's widening in registers (csrc/gemv_avx2.cpp) where that is missing."""
    return capability() in ("AVX512", "AVX2")


bf16_rows._dynamo_marked_constant = True  # type: ignore[attr-defined]


def int8_codes(bits: int = 8) -> bool:
    """Whether quantized weights of `bits` (8 or 4) multiply a bfloat16 row's int8 codes (`row_codes8`) rather than
    the row: AVX512-VNNI's dot product (int4 with bfloat16 scales, where AVX512-BF16 is there too), or AVX2's byte
    products (csrc/gemv_avx2.cpp) on a CPU without AVX512-VNNI."""
    avx2 = capability() == "AVX2" or (capability() == "AVX512" and not int8_dot())
    return avx2 or (int8_dot() and (bits == 8 or bf16_dot()))


int8_codes._dynamo_marked_constant = True  # type: ignore[attr-defined]
ROW_BLOCK8 = 32  # values per scale of a row's int8 codes (csrc/kernels.h, kRowBlock8)


def row_codes8(x: torch.Tensor) -> torch.Tensor:
    """The row [K] as int8 weights multiply it on the int8_dot path, in float64: per block of ROW_BLOCK8 values
    d = max|x| / 127 and codes round(x / d) (to nearest even; 0 where d is 0), the values codes * d; a block with a
    NaN or an infinity keeps its values (the products it enters are NaN)."""
    xf = x.reshape(-1).float()
    K = xf.numel()
    pad = torch.nn.functional.pad(xf, (0, -K % ROW_BLOCK8)).view(-1, ROW_BLOCK8)  # [blocks, 32]
    d = pad.abs().amax(1, keepdim=True) / 127  # [blocks, 1] float32, as the kernel divides
    codes = torch.where(d > 0, torch.round(pad / d).clamp(-127, 127), torch.zeros_like(pad))
    out = (codes.double() * d.double()).view(-1)[:K]
    bad = ~pad.isfinite().all(1, keepdim=True).expand_as(pad).reshape(-1)[:K]
    return torch.where(bad, xf.double(), out)


def _flags() -> tuple[str, list[str]]:
    """The extension's name and compiler flags for this CPU."""
    cap = capability()
    # -fopenmp: at::parallel_for is a header-inline `#pragma omp parallel` in torch's OpenMP build; without the
    # flag the pragma is dropped and the kernel runs on one thread (measured: 2x slower on 2 threads).
    flags = ["-O3", "-fopenmp", f"-DCPU_CAPABILITY={cap}", f"-DCPU_CAPABILITY_{cap}", *_ISA_FLAGS.get(cap, [])]
    flags += ["-mavx512bf16"] if bf16_dot() else []  # gemv_bf16's instruction; without it the op refuses to run
    flags += ["-mavx512vnni"] if int8_dot() else []  # the int8 products' dot product (int8_dot)
    headers = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]
    flags += [f"-DSTATIC_DECODE_HEADERS={headers}"]  # a changed header is a new build, as a changed source is
    return f"static_decode_cpu_{cap.lower()}{'_bf16' if bf16_dot() else ''}{'_vnni' if int8_dot() else ''}", flags


def build_directory(
    name: str | None = None,
    root: str | os.PathLike[str] | None = None,
    torch_version: str = torch.__version__,
    python: tuple[int, int] = (sys.version_info.major, sys.version_info.minor),
    torch_dir: str = os.path.dirname(torch.__file__),
) -> Path:
    """Where the kernels are built: one directory per extension name (the ISA), torch version, Python version and
    torch installation (its include paths are in the build's commands), under $TORCH_EXTENSIONS_DIR or torch's
    default cache. torch's own default is per Python version only, so environments with another torch, or the same
    torch in another virtualenv, rebuilt over each other on every switch (a minute or more each)."""
    from torch.utils.cpp_extension import get_default_build_root  # imported here: it pulls in setuptools

    root = root or os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    where = hashlib.sha256(os.path.realpath(torch_dir).encode()).hexdigest()[:8]
    tag = re.sub(r"[^A-Za-z0-9.]+", "_", f"torch{torch_version}-py{python[0]}{python[1]}") + f"-{where}"
    return Path(root) / f"{name or _flags()[0]}-{tag}"


TICK_SECONDS = 10.0  # how often a build (or a wait for another process's) says how long it has taken so far


@contextlib.contextmanager
def _ticking(what: str, every: float = TICK_SECONDS) -> Iterator[None]:
    """Say on stderr how long `what` has taken so far, every `every` seconds while the body runs: one line
    rewritten in place on a terminal, a line each time elsewhere (a log). A build that takes a minute never looks
    like a hang."""
    done, start = threading.Event(), time.monotonic()
    tty = sys.stderr.isatty()

    def tick() -> None:
        while not done.wait(every):
            text = f"static_decode: {what}: {time.monotonic() - start:.0f} s so far"
            print(f"\r{text}" if tty else text, end="" if tty else "\n", file=sys.stderr, flush=True)

    thread = threading.Thread(target=tick, name="static-decode-build-ticker", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        if tty and time.monotonic() - start >= every:
            print(file=sys.stderr, flush=True)  # end the rewritten line


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """Our own lock on the build directory: an flock, which the kernel releases when its holder dies (Ctrl-C, kill
    -9), unlike torch's lock file. Waits up to $STATIC_DECODE_BUILD_WAIT seconds for another process's build, saying
    so once, then raises TimeoutError (available() warns and takes the formulations without the kernels)."""
    import fcntl  # POSIX: the kernels build on Linux (and macOS)

    wait = float(os.environ.get(WAIT_ENV, BUILD_WAIT))
    with open(directory / "static_decode.flock", "a+") as handle, contextlib.ExitStack() as waiting:
        start, told = time.monotonic(), False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - start > wait:
                    raise TimeoutError(f"another process has been building the CPU kernels in {directory} for over "
                                       f"{wait:.0f} s ({WAIT_ENV})") from None
                if not told:  # the first time: say so, then how long it has been
                    print(f"static_decode: waiting for another process building the CPU kernels in {directory}",
                          file=sys.stderr, flush=True)
                    waiting.enter_context(_ticking("waiting for the other build"))
                    told = True
                time.sleep(0.2)
        waiting.close()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build() -> None:
    from torch.utils.cpp_extension import load  # imported here: it pulls in setuptools

    name, flags = _flags()
    directory = build_directory(name)
    directory.mkdir(parents=True, exist_ok=True)
    # What the build depends on: a stamp written after a build says whether this load compiles (then say so).
    signature = hashlib.sha256(b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS)) + " ".join(flags).encode())
    stamp = directory / "static_decode.stamp"
    with _build_lock(directory):
        # torch's builder holds this file only while it builds, and every builder here holds our lock: left over,
        # it is a killed build's, and torch would wait for it to go away forever.
        (directory / "lock").unlink(missing_ok=True)
        fresh = not stamp.exists() or stamp.read_text() != signature.hexdigest()
        if fresh:
            print(f"static_decode: building the CPU kernels once for this torch and Python (~{BUILD_SECONDS} s on 2 "
                  f"busy cores) into {directory}", file=sys.stderr, flush=True)
        stamp.unlink(missing_ok=True)  # rewritten once the load succeeds: a killed build leaves no stamp
        start = time.monotonic()
        with _ticking("building the CPU kernels") if fresh else contextlib.nullcontext():
            load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                 build_directory=str(directory), is_python_module=False, verbose=False)
        stamp.write_text(signature.hexdigest())
        if fresh:
            print(f"static_decode: the CPU kernels are built ({time.monotonic() - start:.0f} s)", file=sys.stderr,
                  flush=True)


def available() -> bool:
    """Whether the kernels are loaded, building them the first time (once per process; a failed build warns once
    and leaves attention and the projections on the other formulations). A constant for torch.compile: decided
    when a step is traced."""
    if "ok" not in _state:
        if os.environ.get(ENV, "1") == "0":
            _state["ok"] = False
        else:
            try:
                _build()
                _state["ok"] = True
            except Exception as err:  # no compiler, a failed build: everything still works without the kernels
                warnings.warn(f"the CPU kernels could not be built ({err}); attention and the projections use "
                              "torch's own", stacklevel=2)
                _state["ok"] = False
    return _state["ok"]


# Dynamo calls it at trace time and bakes the answer in (what torch.compiler.assume_constant_result marks; set by
# hand so this module never imports torch._dynamo).
available._dynamo_marked_constant = True  # type: ignore[attr-defined]


def supports(rows: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel takes a step of `rows` query rows per KV head, `head_dim`, K/V `dtype`, on `device`
    (without building it): exactly the calls the kernel computes (csrc/checks.h), so "auto" never picks it for
    a shape it would refuse."""
    return device.type == "cpu" and 1 <= rows <= MAX_ROWS and dtype in (*DTYPES, INT8) and head_dim in head_dims()


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens: torch.Tensor,
    n_new: torch.Tensor,
    *,
    window: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, T, d]; k/v [B, Hkv, S, d] cache views (rows contiguous); lens/n_new [B] int64, lens counting the
    chunk. Slot t of row b sees keys 0..lens[b] - n_new[b] + t, and through a sliding `window` (None: none) only
    the last `window` of them, the older keys never read; a padded slot (t >= n_new[b]) returns zeros.
    Returns [B, Hq, T, d] in q's dtype. Call `available()` first."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"decode_attention: window must be None or an int >= 1, got {window!r}")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"decode_attention: q {tuple(q.shape)} and k {tuple(k.shape)} must be rank 4")
    B, Hq, T, d = q.shape
    Hkv = k.shape[1]
    if Hkv < 1 or Hq % Hkv or d < 1:
        raise ValueError(f"decode_attention: {Hq} query heads for {Hkv} KV heads of head_dim {d} (a multiple of "
                         "them, none zero)")
    qf = q.reshape(B, Hkv, Hq // Hkv * T, d)  # [B, Hkv, G*T, d]: row g*T + t; a group shares its KV head
    scale = 1.0 / math.sqrt(d)
    out = torch.ops.static_decode_cpu.decode_attention(qf, k, v, lens, n_new, T, scale, window or 0)  # [B, Hkv, G*T, d]
    return out.view(B, Hq, T, d)



def decode_attention_int8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    lens: torch.Tensor,
    n_new: torch.Tensor,
    *,
    window: int | None = None,
) -> torch.Tensor:
    """`decode_attention` over an int8 cache: k/v [B, Hkv, S, d] int8 codes, k_scale/v_scale [B, Hkv, S] float32
    (value = code * scale; the key axis contiguous), read in place: the codes are widened in registers, a key's
    scale multiplies its score and a value's its softmax weight. Returns [B, Hq, T, d] in q's dtype."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"decode_attention_int8: window must be None or an int >= 1, got {window!r}")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"decode_attention_int8: q {tuple(q.shape)} and k {tuple(k.shape)} must be rank 4")
    B, Hq, T, d = q.shape
    Hkv = k.shape[1]
    if Hkv < 1 or Hq % Hkv or d < 1:
        raise ValueError(f"decode_attention_int8: {Hq} query heads for {Hkv} KV heads of head_dim {d} (a multiple "
                         "of them, none zero)")
    qf = q.reshape(B, Hkv, Hq // Hkv * T, d)  # [B, Hkv, G*T, d]
    out = torch.ops.static_decode_cpu.decode_attention_int8(
        qf, k, v, k_scale, v_scale, lens, n_new, T, 1.0 / math.sqrt(d), window or 0
    )  # [B, Hkv, G*T, d]
    return out.view(B, Hq, T, d)

def gemv_ready(weight: torch.Tensor) -> bool:
    """Whether `gemv_bf16` takes a product with this weight: bfloat16 and contiguous, on a CPU with AVX512-BF16 or
    AVX2 (`bf16_rows`), the kernels built."""
    return (
        weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
        and weight.is_contiguous() and bf16_rows() and available()
    )


def gemv_bf16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [K] (any float dtype; rounded to bfloat16, exact for a bfloat16 model) times weight [N, K] bfloat16 ->
    [N] in x's dtype, accumulated in float32. Check `gemv_ready(weight)` first."""
    return torch.ops.static_decode_cpu.gemv_bf16(x, weight)


def gemv_bf16_cat3(x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x [K] times three bfloat16 weights [Ni, K] in one call -> [N0 + N1 + N2] in x's dtype: the three
    `gemv_bf16` products concatenated (q, k and v of a decode step). Check `gemv_ready` on each weight first."""
    return torch.ops.static_decode_cpu.gemv_bf16_cat3(x, w0, w1, w2)


def gemv_bf16_glu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(x gate^T) * (x up^T) for one row x [K] and bfloat16 gate/up [N, K] -> [N] in x's dtype, each product
    rounded to x's dtype before the silu (as separate calls round it). Check `gemv_ready` on both first."""
    return torch.ops.static_decode_cpu.gemv_bf16_glu(x, gate, up)
