"""GGUF files as --model: a tiny Llama written by transformers, converted by llama.cpp's own converter
(convert_hf_to_gguf.py, f32 / f16 / bf16) and quantized by llama.cpp's quantizer (Q8_0, Q4_0).

References: the save_pretrained directory the GGUFs were converted from (the same model loaded by
static_decode.checkpoints.loading, itself checked against transformers elsewhere); for the quantized files,
transformers' own GGUF reader (`from_pretrained(..., gguf_file=...)`: gguf's dequantization and transformers'
un-permutation of q/k), and gguf's `dequantize` for the int4 weights bit for bit; for the tokenizer, the
directory's tokenizer.json and llama.cpp's tokenizer on the same file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from static_decode.checkpoints.gguf import load_gguf
from static_decode.checkpoints.loading import load_chat_template, load_config, load_model, load_tokenizer
from static_decode.commands import cli
from static_decode.generation.generator import Generator
from static_decode.model.gguf_quant import Blocks, BlockWeight
from static_decode.model.quant import QuantWeight, Scheme
from tests.support import gguf_files
from tests.support.checkpoints import feed, hf_greedy, hf_llama, save, tiny_gguf

PROMPT = [5, 9, 100, 200, 7, 3, 44, 17, 300, 12, 250]
TEXT = "Hello world 12345, it's <|im_start|>user\n  tabs\tand ünïcödé!! I'VE been 3.14<|im_end|>\n\n"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The directory ("dir") and its GGUFs by type, plus the transformers model that wrote the directory."""
    root = tmp_path_factory.mktemp("gguf")
    ckpt = root / "ckpt"
    ckpt.mkdir()
    vocab = gguf_files.bpe_tokenizer(ckpt, "smollm").get_vocab_size()
    save(hf_llama(vocab=vocab, eos=2, seed=3), ckpt)
    out = {"dir": ckpt}
    for outtype in ("f32", "f16", "bf16"):
        out[outtype] = gguf_files.convert(ckpt, outtype, root / f"m-{outtype}.gguf", pre="smollm")
    for qtype in ("Q8_0", "Q4_0"):
        out[qtype] = gguf_files.quantize(out["f32"], qtype, root / f"m-{qtype}.gguf")
    return out


def _greedy(model, n: int = 12) -> list[int]:
    return Generator(model, max_len=64).generate(PROMPT, n)


def test_a_float32_gguf_is_the_directory(files):
    ref, got = load_model(files["dir"]), load_model(files["f32"])
    assert got.config == ref.config and got.dtype == torch.float32
    assert _greedy(got) == _greedy(ref)
    rows = [PROMPT, PROMPT[:4]]
    for a, b in zip(feed(got, rows, 4), feed(ref, rows, 4), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert load_config(files["f32"]) == ref.config


@pytest.mark.parametrize("outtype, dtype", [("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_ggufs_load_in_their_dtype_as_the_directory_cast_to_it(files, outtype, dtype):
    got, ref = load_model(files[outtype]), load_model(files["dir"], dtype=dtype)
    assert got.dtype == dtype
    for (name, a), (_, b) in zip(got.state_dict().items(), ref.state_dict().items(), strict=True):
        assert torch.equal(a, b), name  # the converter's rounding is torch's
    assert _greedy(got) == _greedy(ref)


def _transformers(file: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name,
                                                             dtype=torch.float32).eval()


def test_q8_0_is_held_as_its_blocks(files, capsys):
    got = load_model(files["Q8_0"])
    assert "Q8_0 tensor(s) kept as their blocks (exact)" in capsys.readouterr().err
    assert got.dtype == torch.float32 and not any(isinstance(m, QuantWeight) for m in got.modules())
    assert isinstance(got.layers[0].mlp.down_proj.weight, BlockWeight) and got.quantization == Blocks(("Q8_0",))
    ref = _transformers(files["Q8_0"])
    want = ref(torch.tensor([PROMPT])).logits[0].detach()
    torch.testing.assert_close(feed(got, [PROMPT], 4)[0], want, rtol=0, atol=1e-5)


def test_q4_0_loads_into_int4_bit_for_bit(files, capsys):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    got = load_model(files["Q4_0"])
    err = capsys.readouterr().err
    assert "14 Q4_0 tensor(s) as int4-g32 (exact); 1 Q4_0, 1 Q8_0 tensor(s) kept as their blocks" in err
    assert got.quantization == Blocks(("Q4_0", "Q8_0"))  # the layers int4, the head Q8_0 blocks
    ref = _transformers(files["Q4_0"])
    ref_state = ref.state_dict()
    layer = got.layers[1]
    joined = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}
    for name, parts in joined.items():
        w = layer.get_submodule(name).weight
        assert isinstance(w, QuantWeight) and w.scheme == Scheme(4, 32)
        prefix = name.split(".")[0]
        want = torch.cat([ref_state[f"model.layers.1.{prefix}.{p}.weight"] for p in parts])  # q/k un-permuted
        assert torch.equal(w.dequantize(torch.float32), want), name
    reader = GGUFReader(files["Q4_0"])
    raw = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    down = torch.from_numpy(dequantize(raw.data, raw.tensor_type))  # gguf's own dequantization
    assert torch.equal(layer.mlp.down_proj.weight.dequantize(torch.float32), down)
    want = ref(torch.tensor([PROMPT])).logits[0].detach()
    torch.testing.assert_close(feed(got, [PROMPT], 4)[0], want, rtol=0, atol=1e-5)
    assert _greedy(got, 8) == hf_greedy(ref, PROMPT, 8, eos=2)


def test_q4_0_in_bfloat16_is_held_as_blocks_and_with_quantize_is_dequantized_first(files, capsys):
    bf16 = load_model(files["Q4_0"], dtype="bfloat16")
    assert "15 Q4_0, 1 Q8_0 tensor(s) kept as their blocks (exact)" in capsys.readouterr().err
    assert not any(isinstance(m, QuantWeight) for m in bf16.modules())
    assert bf16.layers[0].mlp.down_proj.weight.scheme.name == "Q4_0"
    int8 = load_model(files["Q4_0"], quantize="int8")
    assert "quantize= asks for our own scheme" in capsys.readouterr().err
    assert int8.quantization == Scheme(8) and int8.layers[0].mlp.down_proj.weight.scheme == Scheme(8)


def test_the_tokenizer_template_and_special_ids_come_from_the_metadata(files):
    ref = load_tokenizer(files["dir"])
    got = load_tokenizer(files["f32"])
    assert got.encode(TEXT).ids == ref.encode(TEXT).ids
    assert got.decode(got.encode(TEXT).ids, skip_special_tokens=False) == TEXT
    template, want = load_chat_template(files["f32"]), load_chat_template(files["dir"])
    assert (template.source, template.bos_token, template.eos_token) == (want.source, "<|im_start|>", "<|im_end|>")
    assert load_config(files["Q4_0"]).eos_token_ids == load_config(files["dir"]).eos_token_ids == (2,)


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "llama-bpe", "qwen2"])
def test_each_pre_tokenizer_encodes_as_the_directory_and_llama_cpp(tmp_path, pre):
    import llama_cpp

    vocab = gguf_files.bpe_tokenizer(tmp_path, pre).get_vocab_size()
    save(hf_llama(vocab=vocab, layers=1), tmp_path)
    file = gguf_files.convert(tmp_path, "f32", tmp_path / "m.gguf", pre=pre)
    text = TEXT + " 1234567 x  \n\n  y's Don't?!  'll 42nd"
    want = load_tokenizer(tmp_path).encode(text).ids
    assert load_tokenizer(file).encode(text).ids == want
    llm = llama_cpp.Llama(str(file), vocab_only=True, verbose=False)
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == want


def test_generate_takes_a_gguf(files, capsys):
    argv = ["generate", "--prompt", "Hello world", "--max-new-tokens", "6"]
    assert cli.main([*argv, "--model", str(files["dir"])]) == 0
    want = capsys.readouterr().out
    assert cli.main([*argv, "--model", str(files["f32"])]) == 0
    assert capsys.readouterr().out == want


def _writer(path: Path, arch: str):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    return w


def _close(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_refusals_name_the_key_and_the_file(tmp_path, files, capsys):
    other = tmp_path / "gemma.gguf"
    w = _writer(other, "gemma")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    _close(w)
    with pytest.raises(ValueError, match=rf"{other}: GGUF key 'general.architecture' is 'gemma'; static-decode "
                                         "loads llama, qwen2, qwen3"):
        load_model(other)
    spm = tmp_path / "spm.gguf"
    tiny_gguf(spm)  # a SentencePiece ("llama") vocabulary
    with pytest.raises(ValueError, match=rf"{spm}: GGUF key 'tokenizer.ggml.model' is 'llama'"):
        load_tokenizer(spm)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(files["f32"].read_bytes()[:5000])
    with pytest.raises(ValueError, match=rf"{cut} is not a readable GGUF file"):
        load_model(cut)
    with pytest.raises(FileNotFoundError, match="GGUF file .*absent.gguf does not exist"):
        load_model(tmp_path / "absent.gguf")
    assert cli.main(["generate", "--model", str(tmp_path / "absent.gguf"), "--prompt-ids", "1"]) == 2
    err = capsys.readouterr().err
    assert "absent.gguf does not exist" in err and "Traceback" not in err
    from static_decode.commands import quantize

    args = cli.build_parser().parse_args(["quantize", "--model", str(files["f32"]), "--quantize", "int8",
                                          "--out", str(tmp_path / "q")])
    with pytest.raises(ValueError, match=rf"{files['f32']} is a GGUF file: load it with --quantize"):
        quantize.run(args)
    assert not (tmp_path / "q").exists()


def test_a_tensor_parallel_rank_reads_the_directory_s_shard(files):
    from static_decode.model.parallel import TensorParallel

    for rank in (0, 1):
        tp = TensorParallel(rank=rank, world=2)
        got, ref = load_gguf(files["f32"], tp=tp).state_dict(), load_model(files["dir"], tp=tp).state_dict()
        assert list(got) == list(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    with pytest.raises(ValueError, match="world size 3 does not divide num_kv_heads=2"):
        load_gguf(files["f32"], tp=TensorParallel(rank=0, world=3))


def test_llama3_rope_factors_are_read_from_rope_freqs(tmp_path):
    """Llama 3.x's rope scaling reaches a GGUF only as rope_freqs (one divisor per frequency, computed by the
    converter): the table divides by them, as llama.cpp does, and the logits are the directory's up to the
    converter's float32 rounding of the factors."""
    from gguf import GGUFReader

    from static_decode.model import rope

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    vocab = gguf_files.bpe_tokenizer(ckpt, "smollm").get_vocab_size()
    save(hf_llama(vocab=vocab, eos=2, seed=6, rope="llama3"), ckpt)
    f32 = gguf_files.convert(ckpt, "f32", tmp_path / "m-f32.gguf", pre="smollm")
    stored = next(t for t in GGUFReader(f32).tensors if t.name == "rope_freqs.weight")
    got, ref = load_model(f32), load_model(ckpt)
    c = got.config
    assert c.rope.type == "default" and c.rope.freq_factors == tuple(float(v) for v in stored.data)
    base = rope.inv_freq(dataclasses.replace(c.rope, freq_factors=()), c.head_dim)
    assert torch.equal(rope.inv_freq(c.rope, c.head_dim), base / torch.from_numpy(stored.data.copy()))
    torch.testing.assert_close(rope.inv_freq(c.rope, c.head_dim), rope.inv_freq(ref.config.rope, c.head_dim),
                               rtol=1e-6, atol=0)
    for a, b in zip(feed(got, [PROMPT], 4), feed(ref, [PROMPT], 4), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="rope freq_factors hold 3 values; the rotary width 8 needs 4"):
        dataclasses.replace(c.rope, freq_factors=(1.0, 2.0, 3.0)).check(8)
    with pytest.raises(ValueError, match="rope freq_factors divide the default table; this rope is 'llama3'"):
        dataclasses.replace(ref.config.rope, freq_factors=(1.0,))
