"""profiles/shapes.py: the named shapes against their published config.json numbers and parameter counts; a cut
shape's checkpoint read by transformers and by static_decode (equal float32 logits), sharded or not; the same
bytes on a rewrite; the streaming writer's peak memory against a budget below the model's size; and the cut
shape through llama.cpp's converter and quantizer into llama_cpp.

The reference numbers below are copied from each model's config.json on the Hugging Face Hub (and the parameter
counts from its safetensors index / model card: 1.24B, 3.21B, 8.03B, 1.54B), independently of the script's table.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import byte_tokenizer, feed, hf_greedy, hf_logits

ROOT = Path(__file__).resolve().parents[2]

# name: (config.json values, parameters of the published checkpoint with its own vocabulary)
LLAMA3_ROPE = {"rope_type": "llama3", "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
PUBLISHED = {
    "Llama-3.2-1B": ({"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                      "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
                      "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                      "rope_parameters": {**LLAMA3_ROPE, "factor": 32.0}}, 1_235_814_400),
    "Llama-3.2-3B": ({"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
                      "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                      "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                      "rope_parameters": {**LLAMA3_ROPE, "factor": 32.0}}, 3_212_749_824),
    "Llama-3.1-8B": ({"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                      "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                      "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                      "rope_parameters": {**LLAMA3_ROPE, "factor": 8.0}}, 8_030_261_248),
    "Qwen2.5-1.5B": ({"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                      "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 151936,
                      "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
                      "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                      "use_sliding_window": False}, 1_543_714_304),
}
SMOLLM2_VOCAB = 49152


@pytest.fixture(scope="module")
def shapes():
    spec = importlib.util.spec_from_file_location("sd_profiles_shapes", ROOT / "profiles" / "shapes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def byte_hf_tokenizer():
    import transformers

    # bytes 1 and 2 as the byte tokenizer spells them (GPT-2's stand-ins for unprintable bytes): ids 1 and 2
    return transformers.PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer(), bos_token=chr(257),
                                                eos_token=chr(258))


def test_every_named_shape_is_the_published_config(shapes):
    assert set(shapes.SHAPES) == set(PUBLISHED)
    for name, (want, parameters) in PUBLISHED.items():
        config = shapes.hf_config(shapes.SHAPES[name]).to_dict()
        assert {k: config[k] for k in want} == want, name
        assert config["architectures"] == ["Qwen2ForCausalLM" if name.startswith("Qwen") else "LlamaForCausalLM"]
        assert config["hidden_act"] == "silu" and config["initializer_range"] == 0.02
        assert shapes.parameter_count(shapes.hf_config(shapes.SHAPES[name])) == parameters, name
        stored = shapes.tensor_plan(shapes.hf_config(shapes.SHAPES[name]))
        assert sum(torch.Size(s).numel() for _, s in stored) == parameters  # a tied head is stored once
        # with SmolLM2's vocabulary the embedding (and an untied head) lose (V - 49152) rows of hidden_size
        heads = 1 if want["tie_word_embeddings"] else 2
        smaller = parameters - heads * (want["vocab_size"] - SMOLLM2_VOCAB) * want["hidden_size"]
        assert shapes.parameter_count(shapes.hf_config(shapes.SHAPES[name], SMOLLM2_VOCAB)) == smaller


def test_cuts(shapes):
    s = shapes.cut(shapes.SHAPES["Llama-3.2-3B"], layers=2, hidden=64)
    assert (s.num_hidden_layers, s.hidden_size, s.num_attention_heads, s.num_key_value_heads, s.head_dim) == (
        2, 64, 4, 1, 16)
    assert s.intermediate_size == 160 and s.rope_scaling == shapes.SHAPES["Llama-3.2-3B"].rope_scaling
    q = shapes.cut(shapes.SHAPES["Qwen2.5-1.5B"], hidden=256)  # 16 heads, group 6 at most: 2 KV heads (8 each)
    assert (q.num_attention_heads, q.num_key_value_heads, q.num_hidden_layers) == (16, 2, 28)
    for bad in ({"layers": 0}, {"layers": 29}, {"hidden": 72}, {"hidden": 4096}):
        with pytest.raises(ValueError):
            shapes.cut(shapes.SHAPES["Llama-3.2-3B"], **bad)
    assert shapes.gguf_types("BF16,Q8_0,q4_0") == ["bf16", "Q8_0", "Q4_0"]
    with pytest.raises(ValueError, match="unknown type"):
        shapes.gguf_types("Q3_K")
    args = shapes.parse_args(["--out", "d", "--shape", "Llama-3.1-8B", "--layers", "2", "--gguf", "F32,Q4_K_M"])
    assert (args.cut.num_hidden_layers, args.gguf, args.dtype, args.vocab) == (2, ["f32", "Q4_K_M"], "bfloat16",
                                                                               "tokenizer")


@pytest.mark.parametrize(("name", "shard_bytes"), [("Llama-3.2-3B", None), ("Qwen2.5-1.5B", 40_000),
                                                   ("Llama-3.1-8B", 40_000)])
def test_a_cut_checkpoint_loads_in_transformers_and_static_decode_alike(shapes, tmp_path, monkeypatch, name,
                                                                        shard_bytes):
    import transformers

    from static_decode import load_model, load_tokenizer

    if shard_bytes is not None:
        monkeypatch.setattr(shapes, "SHARD_BYTES", shard_bytes)
    shape = shapes.cut(shapes.SHAPES[name], layers=2, hidden=64)
    files = shapes.write_checkpoint(tmp_path, shape, "float32", 0, byte_hf_tokenizer())
    if shard_bytes is None:
        assert "model.safetensors" in files
    else:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 2 and all(f in files for f in shards)
        assert index["metadata"]["total_size"] == sum((tmp_path / f).stat().st_size for f in shards) - sum(
            8 + int.from_bytes((tmp_path / f).read_bytes()[:8], "little") for f in shards)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf.config.vocab_size == 256 and hf.config.eos_token_id == 2 and hf.config.bos_token_id == 1
    want = shapes.hf_config(shape, 256).to_dict()
    assert {k: hf.config.to_dict()[k] for k in ("rope_parameters", "tie_word_embeddings", "num_key_value_heads")} == {
        k: want[k] for k in ("rope_parameters", "tie_word_embeddings", "num_key_value_heads")}
    state = hf.state_dict()
    norm, weight = state["model.norm.weight"], state["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(norm, torch.ones_like(norm)) and abs(weight.std().item() - 0.02) < 0.002
    if name.startswith("Qwen"):
        assert torch.count_nonzero(state["model.layers.0.self_attn.q_proj.bias"]) == 0
    model = load_model(tmp_path, dtype=torch.float32)
    assert load_tokenizer(tmp_path).encode("ab").ids == [97, 98]
    prompt = [5, 17, 200, 3, 99, 42, 7, 1, 250]
    ours, theirs = feed(model, [prompt], 4)[0], hf_logits(hf, prompt)
    assert torch.isfinite(theirs).all() and theirs.std() > 0.05
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_the_same_seed_writes_the_same_bytes(shapes, tmp_path):
    shape = shapes.cut(shapes.SHAPES["Llama-3.2-1B"], layers=1, hidden=32)
    a = shapes.write_checkpoint(tmp_path / "a", shape, "bfloat16", 3, None, 128)
    b = shapes.write_checkpoint(tmp_path / "b", shape, "bfloat16", 3, None, 128)
    c = shapes.write_checkpoint(tmp_path / "c", shape, "bfloat16", 4, None, 128)
    assert a == b and a["model.safetensors"] != c["model.safetensors"] and a["config.json"] == c["config.json"]


def test_all_28_layers_stay_finite(shapes, tmp_path):
    """transformers' init scale through Llama-3.2-3B's full depth (narrowed): finite logits of a moderate size."""
    import transformers

    shapes.write_checkpoint(tmp_path, shapes.cut(shapes.SHAPES["Llama-3.2-3B"], hidden=256), "bfloat16", 0, None,
                            256)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.num_hidden_layers == 28
    with torch.no_grad():
        out = hf(torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]), output_hidden_states=True)
    last = out.hidden_states[-2].float()  # the residual stream before the final norm
    assert torch.isfinite(out.logits).all() and 0.05 < out.logits.float().std() < 10
    assert last.pow(2).mean().sqrt() < 50


PEAK = """
import resource, sys
from pathlib import Path
sys.path.insert(0, {profiles!r})
import shapes
config = shapes.hf_config(shapes.cut(shapes.SHAPES["Llama-3.2-1B"], layers=4, hidden=1024), 49152, dtype="float32")
plan = shapes.tensor_plan(config)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
shapes.write_weights(Path({out!r}), config, shapes.DTYPES["float32"], 0)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(sum(4 * shapes.torch.Size(s).numel() for _, s in plan), max(4 * shapes.torch.Size(s).numel() for _, s in plan),
      (after - before) * 1024)
"""


def test_writing_takes_about_one_block_of_memory_not_the_model(tmp_path):
    """A model of 445 MB in float32 (its embedding alone 201 MB) is written with the peak RSS rising by far less
    than the embedding: nothing holds the state dict, or even one whole tensor."""
    code = PEAK.format(profiles=str(ROOT / "profiles"), out=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    total, largest, rise = map(int, out.stdout.split())
    budget = 64 << 20
    assert total > 4 * budget and largest > 2 * budget
    assert sum(p.stat().st_size for p in tmp_path.glob("*.safetensors")) > total
    assert rise < budget, (total, largest, rise)


def _tiny_sentencepiece(path: Path, vocab: int) -> None:
    """A tokenizer.model the converter reads (it needs a vocabulary): SentencePiece trained on README.md."""
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    lines = [ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.strip()]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab,
                                   model_type="bpe", hard_vocab_limit=False, minloglevel=2)
    (path / "tokenizer.model").write_bytes(buf.getvalue())


def test_the_cut_shape_through_llama_cpp(shapes, tmp_path):
    """The converter and quantizer of profiles/smollm2.py on a cut Llama-3.2-3B (llama3 rope scaling, tied head):
    llama.cpp decodes the f32 GGUF as transformers does, and loads the Q8_0 one with its size counted."""
    if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("sentencepiece") is None:
        pytest.skip("llama-cpp-python or sentencepiece not installed (pip install -e '.[llamacpp,real]')")
    import transformers

    from static_decode.commands.bench.lineup import read_gguf
    from static_decode.commands.bench.systems import LlamaCppSystem
    from static_decode.commands.bench.timing import request

    shape = shapes.cut(shapes.SHAPES["Llama-3.2-3B"], layers=2, hidden=64)
    shapes.write_checkpoint(tmp_path, shape, "float32", 1, None, 96)
    _tiny_sentencepiece(tmp_path, 96)
    records = shapes.smollm2.write_ggufs(tmp_path, "float32", ["f32", "Q8_0"], shapes.smollm2.DEFAULT_CACHE)
    assert [r["file"] for r in records] == ["model-f32.gguf", "model-Q8_0.gguf"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 50, 80]
    system = LlamaCppSystem(tmp_path / "model-f32.gguf", max_len=64, threads=1)
    try:
        assert request(system, prompt, 6, None) == hf_greedy(hf, prompt, 7, eos=None)
    finally:
        system.close()
    facts = read_gguf(tmp_path / "model-Q8_0.gguf")
    params = shapes.parameter_count(shapes.hf_config(shape, 96))
    assert facts.file_type == "Q8_0" and params < facts.tensor_bytes < 2 * params  # ~8.5 bits a weight


def test_llama_cpp_s_floor_counts_one_embedding_row_of_an_untied_model(shapes, tmp_path):
    """A cut Llama-3.1-8B (its own LM head): llama.cpp's weight bytes in the bench are the GGUF's tensors less the
    embedding but one row, as static-decode's own count (read_bytes) leaves it, plus the converter's rope_freqs."""
    if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("sentencepiece") is None:
        pytest.skip("llama-cpp-python or sentencepiece not installed (pip install -e '.[llamacpp,real]')")
    from static_decode import load_model
    from static_decode.commands.bench.lineup import read_gguf
    from static_decode.model.quant import read_bytes

    shape = shapes.cut(shapes.SHAPES["Llama-3.1-8B"], layers=1, hidden=64)
    shapes.write_checkpoint(tmp_path, shape, "float32", 2, None, 96)
    _tiny_sentencepiece(tmp_path, 96)
    shapes.smollm2.write_ggufs(tmp_path, "float32", ["f32"], shapes.smollm2.DEFAULT_CACHE)
    facts = read_gguf(tmp_path / "model-f32.gguf")
    params = shapes.parameter_count(shapes.hf_config(shape, 96))
    rope_freqs = 4 * shape.head_dim // 2  # llama3 rope scaling: one float32 factor per rotated pair
    assert facts.tensor_bytes == 4 * (params - 95 * 64) + rope_freqs
    assert facts.tensor_bytes == read_bytes(load_model(tmp_path, dtype=torch.float32)) + rope_freqs
    assert "less the embedding but one row" in facts.counted
