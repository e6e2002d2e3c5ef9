"""GGUF files written by llama.cpp's converter and quantizer (Q4_K_M, Q5_K_M, Q6_K, Q8_0) load with their quantized
tensors held as the file's blocks: every weight dequantizes to what transformers reads from the same file (gguf's
dequantization, q/k rows un-permuted) bit for bit in float32 and rounded once in bfloat16, the weights take the file's
bytes, prefill logits equal transformers' and the compiled steps' greedy tokens the eager ones'. The model is a tiny
llama whose widths are multiples of 256, so that llama.cpp writes K-quant blocks (narrower rows fall back to Q5_0 /
Q8_0 and the like, which SmolLM2's files hold)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from static_decode.checkpoints.gguf import load_gguf
from static_decode.generation.generator import Generator
from static_decode.kernels import cpu_kernel
from static_decode.model.gguf_quant import BlockEmbedding, Blocks, BlockWeight
from static_decode.model.llama import hf_name
from static_decode.model.quant import Scheme, weight_bytes
from tests.support import gguf_files
from tests.support.checkpoints import feed, hf_llama, save

PROMPT = [5, 9, 100, 200, 7, 3, 44, 17, 300, 12, 250]
FILES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf_blocks")
    ckpt = root / "ckpt"
    ckpt.mkdir()
    vocab = gguf_files.bpe_tokenizer(ckpt, "smollm", vocab=512).get_vocab_size()
    save(hf_llama(vocab=vocab, eos=2, seed=4, hidden=256), ckpt)
    f32 = gguf_files.convert(ckpt, "f32", root / "m-f32.gguf", pre="smollm")
    return {q: gguf_files.quantize(f32, q, root / f"m-{q}.gguf") for q in FILES}


def _reference(file: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name,
                                                             dtype=torch.float32).eval()


def _held(model) -> dict[str, BlockWeight]:
    """Our checkpoint-layout name -> the BlockWeight holding it (projections kept apart: load_gguf's
    fused_projections=False)."""
    out = {hf_name(n): m for n, m in model.named_modules() if isinstance(m, BlockWeight) and "embed_tokens" not in n}
    out["model.embed_tokens.weight"] = model.embed_tokens.weight
    return out


@pytest.mark.parametrize("name", FILES)
def test_every_weight_is_the_file_s_value_and_bytes(files, name, capsys):
    from gguf import GGUFReader

    model = load_gguf(files[name], fused_projections=False)
    assert "kept as their blocks (exact)" in capsys.readouterr().err
    assert isinstance(model.embed_tokens, BlockEmbedding) and isinstance(model.quantization, Blocks)
    held = _held(model)
    kinds = {w.scheme.name for w in held.values()}
    assert kinds & {"Q4_K", "Q5_K", "Q6_K", "Q8_0"} and not kinds - {"Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q5_1"}
    ref = _reference(files[name]).state_dict()
    for key, w in held.items():
        assert torch.equal(w.dequantize(torch.float32).view(torch.int32), ref[key].view(torch.int32)), key
    stored = sum(int(t.n_bytes) for t in GGUFReader(files[name]).tensors)
    assert weight_bytes(model) == stored  # norms in float32 as stored, every other tensor its blocks


def test_a_bfloat16_model_rounds_each_value_once(files):
    model = load_gguf(files["Q4_K_M"], dtype=torch.bfloat16, fused_projections=False)
    ref = _reference(files["Q4_K_M"]).state_dict()
    for key, w in _held(model).items():
        assert torch.equal(w.dequantize(torch.bfloat16), ref[key].to(torch.bfloat16)), key


@pytest.mark.parametrize("name", FILES)
def test_prefill_logits_are_transformers(files, name):
    model = load_gguf(files[name])
    want = _reference(files[name])(torch.tensor([PROMPT])).logits[0].detach()
    torch.testing.assert_close(feed(model, [PROMPT], 4)[0], want, rtol=0, atol=1e-4)


def test_one_token_steps_multiply_the_row_codes(files):
    """A one-token step's products take the row's int8 codes (as llama.cpp's do): its logits are those of the same
    model whose products are the float64 ones of gguf's values by the row codes (cpu_kernel.row_codes8)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    def reference(w: BlockWeight):
        values = torch.from_numpy(dequantize(w.blocks.numpy(), GGMLQuantizationType[w.scheme.name])).double()

        def matmul(x: torch.Tensor) -> torch.Tensor:
            rows = x.reshape(-1, w.in_features)
            out = torch.stack([values @ cpu_kernel.row_codes8(r) for r in rows])  # [M, N] float64
            return out.to(x.dtype).reshape(*x.shape[:-1], w.out_features)

        return matmul

    model, ref = load_gguf(files["Q4_K_M"]), load_gguf(files["Q4_K_M"])
    for m in ref.modules():
        if isinstance(m, BlockWeight):
            m.matmul = reference(m)
    torch.testing.assert_close(feed(model, [PROMPT], 1)[0], feed(ref, [PROMPT], 1)[0], rtol=0, atol=1e-4)


def test_compiled_steps_give_the_eager_tokens(files):
    """The greedy steps compiled (one bucket) decode through the fused layers over the blocks, the eager tokens."""
    from capture import CaptureOptions
    from static_decode.steps.functions import GREEDY_KINDS

    model = load_gguf(files["Q4_K_M"])
    eager = Generator(model, max_len=64).generate(PROMPT, 10)
    gen = Generator(model, max_len=64, compile=True,
                    capture=CaptureOptions(buckets=(64,), kinds=GREEDY_KINDS, progress=False))
    assert gen.generate(PROMPT, 10) == eager
    assert gen.runner.regions.fused is not None, gen.runner.regions.fused_why
    gen.runner.close()


def test_a_model_that_would_not_fit_is_refused_before_any_tensor_is_read(files, monkeypatch):
    from static_decode.checkpoints import gguf_plan

    monkeypatch.setattr(gguf_plan, "free_bytes", lambda device: 1024)  # 1 KiB free
    read = []
    monkeypatch.setattr("static_decode.checkpoints.gguf._floats", lambda t: read.append(t) or None)
    with pytest.raises(ValueError, match=r"m-Q4_K_M\.gguf: the model needs 0\.\d\d GiB; cpu has 0\.00 GiB free"):
        load_gguf(files["Q4_K_M"])
    with pytest.raises(ValueError, match=r"the model needs .* GiB, 0\.\d\d GiB of it quantized tensors dequantized "
                                         r"to float32 \(quantize= asks for our own scheme\); cpu has"):
        load_gguf(files["Q4_K_M"], quantize=Scheme(8))
    assert not read
