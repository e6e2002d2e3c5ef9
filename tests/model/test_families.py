"""Model families beyond plain Llama, each loaded from a transformers save_pretrained directory and checked
against the transformers model that wrote it.

Pins, per family (Qwen2, Qwen3, Mistral, Llama with attention_bias / mlp_bias):
* logits equal transformers' within 1e-4 in float32 under chunked prefill (chunks 1, 7, 64) and a ragged batch;
* greedy tokens equal transformers' `generate`, eager and compiled (dynamo with the eager backend; one Qwen3
  case through inductor, marked slow);
* what each family adds is read from its own config.json keys (Qwen2's hard-coded q/k/v biases, Qwen3's q/k
  norms and explicit head_dim, Mistral's bias-free projections), in both transformers 4.x and 5.x spellings;
* a sliding window is read per layer (Qwen `use_sliding_window: false`, or no sliding layer: none) and loads with
  any max_len (windows shorter than the cache: tests/model/test_window_families.py);
* loader errors name the key.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import static_decode.model.llama as model_module
from capture import BucketLadder, CaptureOptions, CompileSettings
from static_decode import Generator, load_model
from tests.support.checkpoints import feed, hf_family, hf_greedy, hf_logits, prompt, rewrite_config, save, to_4x_style

TOL = 1e-4
MAX_LEN = 64  # every cache here; the windowed variants' windows are >= this
GREEDY = ("prefill", "first_greedy", "decode_greedy")

# name -> (family, hf_family kwargs). The first variant of each family is also run compiled.
VARIANTS = {
    "qwen2-tied": ("qwen2", {"tied": True}),
    # A sliding window on layer 1 only (max_window_layers=1), as wide as the cache: on, and exact.
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": MAX_LEN, "max_window_layers": 1}),
    "qwen3-tied": ("qwen3", {"tied": True, "head_dim": 24}),  # 4 heads x 24 != hidden 64: head_dim is read
    "qwen3-bias": ("qwen3", {"head_dim": 24, "attention_bias": True}),
    "mistral": ("mistral", {"sliding_window": None}),
    "mistral-window": ("mistral", {"sliding_window": MAX_LEN}),  # every layer, exactly the cache length
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "llama-mlp-bias": ("llama", {"mlp_bias": True}),
}
COMPILED = ["qwen2-tied", "qwen3-tied", "mistral", "llama-attention-bias"]
# What each variant's config must say (qkv_bias, o_bias, mlp_bias, qk_norm, sliding_window, head_dim, tied).
EXPECTED = {
    "qwen2-tied": (True, False, False, False, None, 16, True),
    "qwen2-window": (True, False, False, False, MAX_LEN, 16, False),
    "qwen3-tied": (False, False, False, True, None, 24, True),
    "qwen3-bias": (True, True, False, True, None, 24, False),
    "mistral": (False, False, False, False, None, 16, False),
    "mistral-window": (False, False, False, False, MAX_LEN, 16, False),
    "llama-attention-bias": (True, True, False, False, None, 16, False),
    "llama-mlp-bias": (False, False, True, False, None, 16, False),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    """(name, transformers model, its save_pretrained directory, our model loaded from it)."""
    family, kwargs = VARIANTS[request.param]
    hf = hf_family(family, seed=len(request.param), **kwargs)
    path = save(hf, tmp_path_factory.mktemp(request.param))
    return request.param, hf, path, load_model(path)


def _switches(cfg) -> tuple:
    return (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias, cfg.qk_norm, cfg.sliding_window, cfg.head_dim,
            cfg.tie_word_embeddings)  # fmt: skip


def test_config_switches(variant):
    name, hf, path, ours = variant
    assert _switches(ours.config) == EXPECTED[name]
    assert ours.config.architecture == hf.config.architectures[0]
    # Every transformers tensor has exactly our parameter (and a tied head is the embedding, not a copy).
    theirs = {k for k, _ in hf.named_parameters()}
    # state_dict(): the checkpoint's names (our q/k/v and gate/up are joined parameters, split back there).
    assert {model_module.hf_name(k) for k in ours.state_dict()} == theirs
    assert (ours.lm_head is None) == ours.config.tie_word_embeddings


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_whole_sequence_in_chunks(variant, chunk):
    _, hf, _, ours = variant
    seq = prompt(40)
    ref = hf_logits(hf, seq)
    assert ref.std() > 0.5, "logits too flat for the comparison to mean anything"
    (got,) = feed(ours, [seq], chunk, max_len=MAX_LEN)
    torch.testing.assert_close(got, ref, atol=TOL, rtol=0)


def test_ragged_batch_fed_together(variant):
    _, hf, _, ours = variant
    rows = [prompt(5, 1), prompt(23, 2), prompt(40, 3)]
    for row, got in zip(rows, feed(ours, rows, 7, max_len=MAX_LEN), strict=True):
        torch.testing.assert_close(got, hf_logits(hf, row), atol=TOL, rtol=0)


def test_greedy_equals_transformers_generate(variant):
    _, hf, _, ours = variant
    gen = Generator(ours, max_len=MAX_LEN, chunk_size=8, eos_token_ids=[])
    for seq in (prompt(13, 4), prompt(3, 5)):  # the second request reuses the generator's cache
        assert gen.generate(seq, 20) == hf_greedy(hf, seq, 20, eos=None)


def _compiled(model, settings: CompileSettings | None) -> Generator:
    opts = CaptureOptions(buckets=BucketLadder((32, MAX_LEN)), settings=settings, kinds=GREEDY, progress=False)
    return Generator(model, max_len=MAX_LEN, chunk_size=8, eos_token_ids=[], compile=True, capture=opts)


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_greedy_equals_transformers_generate(name, tmp_path):
    family, kwargs = VARIANTS[name]
    hf = hf_family(family, seed=len(name), **kwargs)
    gen = _compiled(load_model(save(hf, tmp_path)), CompileSettings(backend="eager"))
    for seq in (prompt(13, 4), prompt(3, 5)):
        assert gen.generate(seq, 20) == hf_greedy(hf, seq, 20, eos=None)
    records = gen.capture_records
    assert records and all((r.graph_breaks, r.fallback) == (0, "") for r in records)  # compiled, not eager


@pytest.mark.slow
def test_qwen3_inductor_greedy_equals_transformers_generate(tmp_path):
    """The CPU default compile (inductor, C++ wrapper) over the q/k norms and the biases."""
    family, kwargs = VARIANTS["qwen3-bias"]
    hf = hf_family(family, seed=3, **kwargs)
    gen = _compiled(load_model(save(hf, tmp_path)), None)
    seq = prompt(13, 4)
    assert gen.generate(seq, 20) == hf_greedy(hf, seq, 20, eos=None)


# ---- config.json spellings ---------------------------------------------------------------------------------
def copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def test_4x_style_config_loads_the_same_model(variant, tmp_path):
    """transformers 4.x files: rope_theta + rope_scaling, and Qwen's sliding window without `layer_types`."""
    _, hf, path, ours = variant
    old = copy(path, tmp_path)
    rewrite_config(old, lambda c: (to_4x_style(c), c.pop("layer_types", None)))
    cfg = json.loads((old / "config.json").read_text())
    assert "rope_parameters" not in cfg and cfg["rope_theta"] == 1e6
    assert load_model(old).config == ours.config


def qwen_window(tmp_path: Path, family: str, **keys) -> int | None:
    """The sliding window our loader reads from a Qwen config.json with these keys (4.x: no layer_types)."""
    hf = hf_family(family, layers=2)
    path = save(hf, tmp_path / f"{family}-{len(list(tmp_path.iterdir()))}")
    rewrite_config(path, lambda c: (c.pop("layer_types", None), c.update(keys)))
    return load_model(path).config.sliding_window


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_sliding_window_only_when_on_and_some_layer_slides(family, tmp_path):
    # Released Qwen checkpoints ship use_sliding_window false next to a small sliding_window: no window.
    assert qwen_window(tmp_path, family, use_sliding_window=False, sliding_window=16) is None
    # On, but max_window_layers covers every layer: no layer slides.
    assert qwen_window(tmp_path, family, use_sliding_window=True, sliding_window=16, max_window_layers=2) is None
    assert qwen_window(tmp_path, family, use_sliding_window=True, sliding_window=16, max_window_layers=1) == 16
    # 5.x files list the layer kinds.
    on = {"use_sliding_window": True, "sliding_window": 16}
    assert qwen_window(tmp_path, family, **on, layer_types=["full_attention"] * 2) is None
    assert qwen_window(tmp_path, family, **on, layer_types=["full_attention", "sliding_attention"]) == 16


# ---- windows shorter than the cache load -----------------------------------------------------------------------
def test_window_smaller_than_max_len_loads(tmp_path):
    path = save(hf_family("mistral", sliding_window=16), tmp_path)
    model = load_model(path)
    assert model.config.sliding_window == 16 and model.config.layer_windows == (16, 16)
    for max_len in (16, 17, 64):
        Generator(model, max_len=max_len, batch=1).generate([1, 2, 3], 4)
    path = save(hf_family("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1), tmp_path / "q")
    assert load_model(path).config.layer_windows == (None, 16)
    Generator(load_model(path), max_len=32)


# ---- loader errors name the key ------------------------------------------------------------------------------
def edit_weights(ckpt: Path, edit) -> None:
    file = ckpt / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def refuses(path: Path, error: type[Exception], *words: str) -> None:
    with pytest.raises(error) as info:
        load_model(path)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {info.value}"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("errors")
    return {
        "qwen2": save(hf_family("qwen2"), root / "qwen2"),
        "qwen3": save(hf_family("qwen3", head_dim=24), root / "qwen3"),
        "mistral": save(hf_family("mistral", sliding_window=None), root / "mistral"),
        "llama": save(hf_family("llama", attention_bias=True), root / "llama"),
    }


Q = "model.layers.1.self_attn."


@pytest.mark.parametrize(
    ("family", "edit", "error", "words"),
    [
        # Qwen2's q/k/v biases are not optional, and it has none on o_proj.
        ("qwen2", lambda t: t.pop(Q + "k_proj.bias"), KeyError, [Q + "k_proj.bias"]),
        ("qwen2", lambda t: t.update({Q + "o_proj.bias": torch.zeros(64)}), KeyError, [Q + "o_proj.bias"]),
        # Qwen3's per-head norms: missing, or one weight per query feature instead of per head dim.
        ("qwen3", lambda t: t.pop(Q + "q_norm.weight"), KeyError, [Q + "q_norm.weight"]),
        ("qwen3", lambda t: t.update({Q + "k_norm.weight": torch.ones(48)}), ValueError,
         [Q + "k_norm.weight", "(48,)", "(24,)"]),
        # Mistral is bias-free.
        ("mistral", lambda t: t.update({Q + "q_proj.bias": torch.zeros(64)}), KeyError, [Q + "q_proj.bias"]),
        # Llama attention_bias: o_proj's bias belongs to it too.
        ("llama", lambda t: t.pop(Q + "o_proj.bias"), KeyError, [Q + "o_proj.bias"]),
    ],
)  # fmt: skip
def test_tensor_errors_name_the_key(ckpts, tmp_path, family, edit, error, words):
    ckpt = copy(ckpts[family], tmp_path)
    edit_weights(ckpt, edit)
    refuses(ckpt, error, *words)


@pytest.mark.parametrize(
    ("family", "edit", "error", "words"),
    [
        # Without head_dim Qwen3 means transformers' default 128, not hidden_size // heads (16): the projections
        # saved for 24 no longer fit, and the error names the first one.
        ("qwen3", lambda c: c.pop("head_dim"), ValueError, ["q_proj.weight", "(96, 64)", "(512, 64)"]),
        ("qwen3", lambda c: c.update(attention_bias="yes"), ValueError, ["attention_bias"]),
        ("llama", lambda c: c.update(mlp_bias=1), ValueError, ["mlp_bias"]),
        ("mistral", lambda c: c.update(sliding_window=4096.0), TypeError, ["sliding_window"]),
        ("mistral", lambda c: c.update(sliding_window=0), ValueError, ["sliding_window"]),
        ("qwen2", lambda c: c.update(use_sliding_window=True, sliding_window=8, layer_types=["full", "local"]),
         ValueError, ["layer_types", "local"]),
        ("qwen2", lambda c: c.update(architectures=["Qwen2MoeForCausalLM"]), ValueError,
         ["architectures", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM"]),
    ],
)  # fmt: skip
def test_config_errors_name_the_key(ckpts, tmp_path, family, edit, error, words):
    ckpt = copy(ckpts[family], tmp_path)
    rewrite_config(ckpt, edit)
    refuses(ckpt, error, *words)
