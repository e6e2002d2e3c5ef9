"""The CPU kernels' boundary (csrc/checks.h): whatever a caller passes, an op computes, or raises an exception naming
the argument and the value with every tensor it was given exactly as it was; it never crashes, never writes out of
bounds, never clamps a length the reference refuses. Then what the kernels compute and what `supports()` promises
agree for every head size, NaN comes out where it goes in, and the build neither hangs on a killed build's lock nor
shares its directory across torch or Python versions.

The hostile calls run in one subprocess (`python -m tests.kernels.test_native_boundary`): a crash fails the tests that
follow it here instead of ending pytest. Each case prints one JSON line: what it raised, the message, and whether
the cache (and its guard rows) stayed bit-identical.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from static_decode import Generator, Llama, LlamaConfig
from static_decode.core.attention import grouped_attention, resolve_impl
from static_decode.kernels import cpu_kernel
from static_decode.model.quant import QuantWeight, Scheme

ROOT = Path(__file__).resolve().parents[2]
OPS = torch.ops.static_decode_cpu
CFG = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16)
needs_kernels = pytest.mark.skipif(not cpu_kernel.available(), reason="the CPU kernels did not build here")


def layers_call(n: int = 1, lens: int = 5, lens_after: int | None = None, read_len: int = 8, *, max_len: int = 8,
                hkv: int = 2, d: int = 16, kv_dtype: torch.dtype = torch.float32, q_rows: list[int] | None = None):
    """decode_layers' arguments for 2 layers of a float32 model (D 32, 2 query heads a KV head), the cache a view
    with two guard rows either side of its key axis: (call, guarded buffers)."""
    gen = torch.Generator().manual_seed(0)
    D, inner, nkv = 32, 48, hkv * d
    nq = q_rows or [2 * nkv, 2 * nkv]
    weights = []
    for layer in range(2):
        for shape in ((D,), (nq[layer], D), (nkv, D), (nkv, D), (D, nq[layer]), (D,), (inner, D), (inner, D),
                      (D, inner)):
            weights.append(torch.randn(shape, generator=gen) * 0.2)
    kbuf, vbuf = (torch.randn(2, 1, hkv, max_len + 1 + 4, d, generator=gen).to(kv_dtype) for _ in range(2))
    k, v = kbuf[:, :, :, 2:-2], vbuf[:, :, :, 2:-2]
    x = torch.randn(1, 1, D, generator=gen)
    cos, sin = torch.randn(1, 1, 1, d // 2, generator=gen), torch.randn(1, 1, 1, d // 2, generator=gen)
    after = lens + n if lens_after is None else lens_after
    args = (x, cos, sin, k, v, torch.tensor([lens]), torch.tensor([n]), torch.tensor([after]), read_len, weights, 1e-5)
    return (lambda: OPS.decode_layers(*args)), (kbuf, vbuf)


def layers_kv8_call(lens: int = 5, *, scale: str = "good", codes: torch.dtype = torch.int8):
    """decode_layers_kv8's arguments: layers_call's float32 model over an int8 cache, codes and scales guarded the
    same way; `scale` breaks the scales ("float64", "short": one key row fewer, "strided": the key axis not
    contiguous, "batch2"), `codes` the cache's dtype: (call, guarded buffers)."""
    gen = torch.Generator().manual_seed(3)
    hkv, d, max_len = 2, 16, 8
    D, inner, nkv = 32, 48, hkv * d
    weights = [torch.randn(shape, generator=gen) * 0.2 for _ in range(2)
               for shape in ((D,), (2 * nkv, D), (nkv, D), (nkv, D), (D, 2 * nkv), (D,), (inner, D), (inner, D),
                             (D, inner))]
    cos, sin = torch.randn(1, 1, 1, d // 2, generator=gen), torch.randn(1, 1, 1, d // 2, generator=gen)
    kbuf, vbuf = (torch.randint(-127, 128, (2, 1, hkv, max_len + 1 + 4, d), generator=gen).to(codes) for _ in range(2))
    ksbuf, vsbuf = (torch.rand(2, 1, hkv, 2 * (max_len + 1 + 4), generator=gen) for _ in range(2))
    k, v = kbuf[:, :, :, 2:-2], vbuf[:, :, :, 2:-2]
    ks, vs = ksbuf[..., 2:2 + max_len + 1], vsbuf[..., 2:2 + max_len + 1]
    if scale == "float64":
        ks = ks.double()
    elif scale == "short":
        ks = ks[..., :-1]
    elif scale == "strided":
        ks = ksbuf[..., 2:2 + 2 * (max_len + 1):2]
    elif scale == "batch2":
        ks = ks.expand(2, 2, hkv, max_len + 1)
    x = torch.randn(1, 1, D, generator=gen)
    args = (x, cos, sin, k, v, ks, vs, torch.tensor([lens]), torch.tensor([1]), torch.tensor([lens + 1]), 8, weights,
            [], -1, 1e-5)
    return (lambda: OPS.decode_layers_kv8(*args)), (kbuf, vbuf, ksbuf, vsbuf)


def layers_q_call(lens: int = 5, *, float_q: bool = False, drop_scale: bool = False):
    """decode_layers_q's arguments for 2 layers of an int4-g32 float32 model (D 64, inner 128, 2 KV heads of 16, 2
    query heads a KV head), the cache guarded as layers_call's; `float_q`: layer 0's q a float weight in place of
    its codes; `drop_scale`: 13 scales: (call, guarded buffers)."""
    gen = torch.Generator().manual_seed(2)
    D, inner, d, hkv, max_len = 64, 128, 16, 2, 8
    weights, scales = [], []
    for _ in range(2):
        for shape in ((D,), (2 * hkv * d, D), (hkv * d, D), (hkv * d, D), (D, 2 * hkv * d), (D,), (inner, D),
                      (inner, D), (D, inner)):
            w = torch.randn(shape, generator=gen) * 0.2
            qw = QuantWeight(w, Scheme(4, 32)) if w.dim() == 2 else None
            weights.append(w if qw is None else qw.qweight)
            scales += [] if qw is None else [qw.scales]
    if float_q:
        weights[1] = torch.randn(2 * hkv * d, D, generator=gen)
    if drop_scale:
        scales.pop()
    kbuf, vbuf = (torch.randn(2, 1, hkv, max_len + 1 + 4, d, generator=gen) for _ in range(2))
    k, v = kbuf[:, :, :, 2:-2], vbuf[:, :, :, 2:-2]
    x = torch.randn(1, 1, D, generator=gen)
    cos, sin = torch.randn(1, 1, 1, d // 2, generator=gen), torch.randn(1, 1, 1, d // 2, generator=gen)
    args = (x, cos, sin, k, v, torch.tensor([lens]), torch.tensor([1]), torch.tensor([lens + 1]), 8, weights, scales,
            32, 1e-5)
    return (lambda: OPS.decode_layers_q(*args)), (kbuf, vbuf)


def gemv_q_call(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group: int):
    return (lambda: OPS.gemv_q(x, qweight, scales, group)), (x, qweight, scales)


def attention_call(lens: list[int], n_new: list[int], *, B: int = 2, S: int = 8, d: int = 16, slots: int = 1):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, 2, 3 * slots, d, generator=gen)
    k, v = torch.randn(2, B, 2, S, d, generator=gen)
    saved = (k.clone(), v.clone())
    args = (q, k, v, torch.tensor(lens, dtype=torch.int64), torch.tensor(n_new, dtype=torch.int64), slots, 0.25)
    return (lambda: OPS.decode_attention(*args)), (k, v), saved


# name -> (a call and the tensors it must leave as they were; the message it must raise)
def cases() -> dict:
    out = {
        "layers: lens past the cache": (layers_call(lens=8), r"lens 8 outside 0\.\.7"),
        "layers: lens = max_len + 1": (layers_call(lens=9, read_len=8), r"lens 9 outside"),
        "layers: lens = -1": (layers_call(lens=-1), r"lens -1 outside"),
        "layers: lens = 10**9": (layers_call(lens=10**9), r"lens 1000000000 outside"),
        "layers: lens_after past read_len": (layers_call(lens=5, read_len=5), r"lens_after 6 .* read_len 5"),
        "layers: lens_after not lens + n_new": (layers_call(lens=3, lens_after=5),
                                                r"lens_after 5 is not lens \+ n_new = 4"),
        "layers: n_new 2": (layers_call(n=2, lens=3), r"n_new 2"),
        "layers: float64 cache": (layers_call(kv_dtype=torch.float64), r"K/V dtypes Double"),
        "layers: head_dim 112": (layers_call(d=112), r"head_dim 112 is not supported"),
        "layers: zero KV heads": (layers_call(hkv=0), r"no layer or no KV head"),
        "layers: head_dim 0": (layers_call(d=0), r"head_dim 0 is not supported"),
        "layers: layer 1's q rows differ": (layers_call(q_rows=[64, 128]), r"layer 1 weight 1"),
        "layers_kv8: lens = 10**9": (layers_kv8_call(lens=10**9), r"lens 1000000000 outside 0\.\.7"),
        "layers_kv8: float64 scales": (layers_kv8_call(scale="float64"), r"k_scale Double .* must be float32"),
        "layers_kv8: scales a key row short": (layers_kv8_call(scale="short"), r"k_scale Float \[2, 1, 2, 8\]"),
        "layers_kv8: strided scales": (layers_kv8_call(scale="strided"), r"k_scale .* key axis contiguous"),
        "layers_kv8: scales of batch 2": (layers_kv8_call(scale="batch2"), r"k_scale Float \[2, 2, 2, 9\]"),
        "layers_kv8: float codes": (layers_kv8_call(codes=torch.float32), r"int8 cache's K/V are Float/Float"),
        "layers: an int8 cache without scales": (layers_call(kv_dtype=torch.int8), r"K/V dtypes Char/Char"),
        "layers_q: lens = 10**9": (layers_q_call(lens=10**9), r"lens 1000000000 outside 0\.\.7"),
        "layers_q: a float weight where codes belong": (
            layers_q_call(float_q=True), r"layer 0 weight 1: int4 codes must be packed uint8, got Float"),
        "layers_q: 13 scales for 2 layers": (layers_q_call(drop_scale=True),
                                             r"13 scales for 2 layers of quantized weights \(7 a layer\)"),
    }
    g32 = QuantWeight(torch.randn(6, 128), Scheme(4, 32))
    out["gemv_q: int4 K 96"] = (gemv_q_call(torch.randn(96), g32.qweight[:, :48].contiguous(),
                                            g32.scales[:, :3].contiguous(), 32), r"K a multiple of 64 .*got K 96")
    out["gemv_q: int8 scales for 7 rows of 6"] = (
        gemv_q_call(torch.randn(40), torch.ones(6, 40, dtype=torch.int8), torch.ones(7), 0),
        r"int8 scales must be \[6\], got \[7\]")
    out["linear_q: one row [K], not [M, K]"] = (
        ((lambda: OPS.linear_q(torch.randn(128), g32.qweight, g32.scales, 32)), (g32.qweight, g32.scales)),
        r"x \[128\] is not \[M, 128\]")
    out["linear_q: float16 rows"] = (
        ((lambda: OPS.linear_q(torch.randn(2, 128).half(), g32.qweight, g32.scales, 32)), (g32.qweight, g32.scales)),
        r"x's dtype Half is not float32/bfloat16")
    out["dequant_q: int4 scales of another group"] = (
        ((lambda: OPS.dequant_q(g32.qweight, g32.scales, 64, torch.float32)), (g32.qweight, g32.scales)),
        r"int4 scales must be \[6, 2, 2\], got \[6, 4, 2\]")
    out["dequant_q: float16 out"] = (
        ((lambda: OPS.dequant_q(g32.qweight, g32.scales, 32, torch.float16)), (g32.qweight, g32.scales)),
        r"dtype Half \(float32 or bfloat16\)")
    for name, lens, n_new, pattern in (
        ("attention: empty lens", [], [], r"lens must hold 2 int64 values"),
        ("attention: lens shorter than the batch", [3], [1], r"lens must hold 2 int64 values"),
        ("attention: lens past the keys read", [9, 3], [1, 1], r"lens\[0\] = 9 outside 1\.\.8"),
        ("attention: n_new past lens", [3, 0], [1, 1], r"lens\[1\] = 0 outside 1\.\.8"),
        ("attention: n_new past the slots", [3, 4], [1, 2], r"n_new\[1\] = 2 outside 0\.\.1"),
        ("attention: negative n_new", [3, 4], [1, -1], r"n_new\[1\] = -1 outside"),
    ):
        call, tensors, saved = attention_call(lens, n_new)
        out[name] = ((call, tensors, saved), pattern)
    call, tensors, saved = attention_call([3, 3], [1, 1], d=0)
    out["attention: head_dim 0"] = ((call, tensors, saved), r"head_dim 0 is not supported")
    call, tensors, saved = attention_call([3, 3], [1, 1], d=96, slots=30)
    out["attention: 90 rows a KV head"] = ((call, tensors, saved), r"90 query rows for slots 30")
    if cpu_kernel.bf16_rows():
        w = torch.randn(6, 8).bfloat16()
        out["gemv: x [2, 4] for K 8"] = (((lambda: OPS.gemv_bf16(torch.randn(2, 4), w)), (w,), (w.clone(),)),
                                          r"x \[2, 4\] is not one row of the 8 values")
        out["gemv: x [8, 1] for K 8"] = (((lambda: OPS.gemv_bf16_glu(torch.randn(8, 1), w, w)), (w,), (w.clone(),)),
                                          r"x \[8, 1\] is not one row")
    return out


def run_cases() -> None:
    for name, (setup, _) in cases().items():
        call, tensors = setup[0], setup[1]
        saved = setup[2] if len(setup) > 2 else tuple(t.clone() for t in tensors)
        try:
            call()
            raised, message = None, ""
        except Exception as err:
            raised, message = type(err).__name__, str(err).splitlines()[0]
        same = all(torch.equal(a, b) for a, b in zip(saved, tensors, strict=True))
        print(json.dumps({"name": name, "raised": raised, "message": message, "unchanged": same}), flush=True)


@pytest.fixture(scope="module")
def outcomes() -> dict[str, dict]:
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.test_native_boundary"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    found = {line["name"]: line for line in lines}
    found["_exit"] = {"code": proc.returncode, "stderr": proc.stderr[-2000:]}
    return found


@needs_kernels
@pytest.mark.parametrize("name", list(cases()))
def test_a_bad_call_raises_by_name_and_writes_nothing(outcomes: dict[str, dict], name: str) -> None:
    got = outcomes.get(name)
    assert got is not None, f"the case process ended before this case (exit {outcomes['_exit']})"
    assert got["raised"] == "RuntimeError", got
    assert re.search(cases()[name][1], got["message"]), got
    assert got["unchanged"], f"the refused call changed a tensor it was given: {got}"


@needs_kernels
def test_fused_layers_refuse_a_length_past_the_cache() -> None:
    """Through the wrapper a capture region calls: a length of 10**9 is refused by name, the cache untouched."""
    from static_decode.model.fused_decode import FusedLayers

    model = Llama(CFG, dtype=torch.float32)
    cache = model.new_cache(1, 16)
    layers, k = FusedLayers(model, 0, CFG.num_layers), cache.k.clone()
    x, cs = torch.randn(1, 1, CFG.hidden_size), torch.ones(1, 1, 1, CFG.head_dim // 2)
    big = torch.tensor([10**9])
    with pytest.raises(RuntimeError, match="lens 1000000000 outside 0..15"):
        layers(x, cs, cs, cache.k, cache.v, big, torch.tensor([1]), big + 1, 16)
    assert torch.equal(cache.k, k)


# ---- what the kernel computes and what supports() promises -----------------------------------------------------
@pytest.mark.parametrize("cap", ["AVX512", "AVX2", "DEFAULT"])
def test_supports_is_the_kernels_head_dims_for_each_isa(cap: str) -> None:
    """Every multiple of 16 up to 256: the sizes with code (csrc/checks.h) on every ISA the project builds, the rest
    routed to another formulation; the 8-float vectors of AVX2 and the portable build add head_dim 8."""
    assert [d for d in range(16, 257, 16) if d in cpu_kernel.head_dims(cap)] == [16, 32, 48, 64, 80, 96, 128, 256]
    assert (8 in cpu_kernel.head_dims(cap)) == (cap != "AVX512")
    assert 12 not in cpu_kernel.head_dims(cap)


@needs_kernels
@pytest.mark.parametrize("d", [8, *range(16, 257, 16), 24, 272])
def test_supports_agrees_with_the_built_kernel(d: int) -> None:
    """This machine's build: the kernel runs exactly the head sizes supports() names (and equals the float64
    formulation there); "auto" resolves to it exactly then, and to a general formulation otherwise."""
    cpu = torch.device("cpu")
    q, k, v = torch.randn(1, 3, 2, d), torch.randn(1, 3, 40, d), torch.randn(1, 3, 40, d)
    lens, n_new = torch.tensor([30]), torch.tensor([2])
    if cpu_kernel.supports(2, d, torch.float32, cpu):
        out = OPS.decode_attention(q, k, v, lens, n_new, 2, 1 / math.sqrt(d))
        want = grouped_attention(q.double(), k.double(), v.double(), lens, n_new, impl="matmul")
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
        assert resolve_impl("auto", 1, 3, 2, cpu, d, torch.float32) == "decode_kernel"
    else:
        with pytest.raises(RuntimeError, match=f"head_dim {d} is not supported"):
            OPS.decode_attention(q, k, v, lens, n_new, 2, 1.0)
        assert resolve_impl("auto", 1, 3, 2, cpu, d, torch.float32) != "decode_kernel"
        assert resolve_impl("decode_kernel", 1, 3, 2, cpu, d, torch.float32) == "sdpa_folded"


@needs_kernels
@pytest.mark.parametrize("head_dim", [48, 80, 96, 112])
def test_a_model_runs_at_any_head_size(head_dim: int) -> None:
    """A Generator decodes a model of head_dim 48/80/96 (the kernel) or 112 (another formulation) with the tokens
    the "matmul" formulation gives."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=head_dim)
    torch.manual_seed(0)
    model = Llama(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    tokens = Generator(model, max_len=32, compile=False).generate([3, 5, 7], 6, stop_at_eos=False)
    model.attn_impl = "matmul"
    assert len(tokens) == 6
    assert Generator(model, max_len=32, compile=False).generate([3, 5, 7], 6, stop_at_eos=False) == tokens


@needs_kernels
@pytest.mark.parametrize("where", ["q", "k"])
def test_nan_in_gives_nan_out_as_the_other_formulations(where: str) -> None:
    """A NaN query or visible key: NaN in the rows that read it, as "matmul" gives (not zeros); rows that do not
    read it stay finite, padded slots zeros."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 4, 2, 64, generator=gen), *torch.randn(2, 2, 2, 700, 64, generator=gen)
    (q[0, 1, 0] if where == "q" else k[0, 0, 600]).fill_(math.nan)  # row 0: query head 1 / KV head 0's key 600
    lens, n_new = torch.tensor([650, 650]), torch.tensor([2, 1])
    got = grouped_attention(q, k, v, lens, n_new, impl="decode_kernel")
    want = grouped_attention(q, k, v, lens, n_new, impl="matmul")
    assert got.isnan().any() and torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got.nan_to_num(7.0), want.nan_to_num(7.0), atol=1e-4, rtol=1e-4)
    assert not got[1].isnan().any() and not got[1, :, 1:].any()  # row 1 never reads it; its padded slot is zero


# ---- the build: its directory, its message, a killed build's lock -----------------------------------------------
def test_build_directory_is_per_torch_python_and_environment(tmp_path: Path) -> None:
    """Environments never share a build: another torch version, Python version or torch installation (a second
    virtualenv with the same versions) is another directory; the same one is the same directory."""
    def where(torch_version: str = "2.13.0+cpu", python: tuple[int, int] = (3, 11), env: str = "/venv/a/torch",
              name: str = "static_decode_cpu_avx2") -> Path:
        return cpu_kernel.build_directory(name, tmp_path, torch_version, python, env)

    base = where()
    assert base == where() and base.parent == tmp_path and base.name.startswith("static_decode_cpu_avx2-")
    assert "2.13.0" in base.name and "py311" in base.name and "/" not in base.name and "+" not in base.name
    others = {where("2.11.0"), where(python=(3, 12)), where("2.13.0+cu128"), where(env="/venv/b/torch"),
              where(name="static_decode_cpu_avx512")}
    assert base not in others and len(others) == 5
    assert cpu_kernel.build_directory().name.startswith(cpu_kernel._flags()[0] + "-torch")  # this environment's


def test_a_build_says_what_it_does_and_a_load_says_nothing(tmp_path: Path, monkeypatch, capfd) -> None:
    import torch.utils.cpp_extension as ext

    built = []
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(ext, "load", lambda **kw: built.append(kw["build_directory"]))
    cpu_kernel._build()
    err = capfd.readouterr().err
    assert "building the CPU kernels once" in err and f"~{cpu_kernel.BUILD_SECONDS} s" in err and "built (" in err
    cpu_kernel._build()  # the stamp matches: a load (torch's ninja finds nothing to do), no message
    assert capfd.readouterr().err == "" and len(built) == 2 and built[0].startswith(str(tmp_path))


@needs_kernels
def test_a_killed_builds_lock_does_not_hang_the_next_process(tmp_path: Path) -> None:
    """torch's lock file left by a build killed part-way (copied next to a finished build): the next process
    removes it under our own lock and loads; before, it waited for the file forever."""
    built = cpu_kernel.build_directory()
    copy = cpu_kernel.build_directory(root=tmp_path)
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", "*.flock"))
    (copy / "lock").touch()
    code = "from static_decode.kernels import cpu_kernel; assert cpu_kernel.available(); print('loaded')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr[-2000:]
    assert not (copy / "lock").exists()


def test_a_build_in_progress_elsewhere_is_waited_for_then_given_up_on(tmp_path: Path) -> None:
    """Another live process holds our build lock: the next one says it waits, gives up after STATIC_DECODE_BUILD_WAIT
    seconds with a warning, and runs without the kernels (no hang)."""
    name = cpu_kernel._flags()[0]
    directory = cpu_kernel.build_directory(name, tmp_path)
    directory.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, sys, time
        f = open({str(directory / 'static_decode.flock')!r}, 'a+'); fcntl.flock(f, fcntl.LOCK_EX)
        print("held", flush=True); time.sleep(600)""")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        code = "from static_decode.kernels import cpu_kernel; print('available', cpu_kernel.available())"
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), cpu_kernel.WAIT_ENV: "1"})
    finally:
        holder.kill()
        holder.wait()
    assert "available False" in proc.stdout, proc.stderr[-2000:]
    assert "waiting for another process building the CPU kernels" in proc.stderr
    assert "could not be built" in proc.stderr and cpu_kernel.WAIT_ENV in proc.stderr


if __name__ == "__main__":
    torch.set_num_threads(1)
    assert cpu_kernel.available()
    run_cases()
