"""Quantized checkpoints (static_decode.checkpoints.quant_io, `static-decode quantize`): saved once, loaded without
quantizing.

Pins:
* a saved and reloaded model holds the in-memory quantized model's tensors exactly, so its logits are equal to
  the bit and its greedy tokens equal: int8 and int4, float32 and bfloat16, tied and untied heads, biases;
* loading runs no quantization pass;
* the CLI writes a directory `generate` runs on, with the same tokens as quantizing at load; its files are
  smaller than the float checkpoint's, by what the formats hold;
* --quantize with a quantized checkpoint: its own scheme is a no-op, another is refused naming both; a missing,
  mis-shaped, non-finite or truncated tensor, a layout this version does not read, a dtype the scales were not
  rounded to: each refused in one line naming it;
* tensor parallelism: a rank's shard is its slices of the saved weights (dequantized, exactly), equal to the shard
  quantizing at load gives; 2 gloo ranks decode the single process's tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from static_decode import Generator, load_model
from static_decode.checkpoints import quant_io
from static_decode.checkpoints.loading import default_model_path
from static_decode.model import quant
from static_decode.model.parallel import TensorParallel, open_group, shard_dim
from tests.support.checkpoints import feed, hf_llama, save

ROWS = [list(range(3, 40)), [7, 1, 99, 4]]  # ragged, through chunked prefill
PROMPTS = [[5, 9, 2, 7, 7, 1, 3], list(range(1, 30))]


def _saved(tmp_path: Path, spec: str, dtype: torch.dtype = torch.float32, src: Path | None = None):
    """(the in-memory quantized model, the directory it was saved to)."""
    src = default_model_path() if src is None else src
    model = load_model(src, dtype=dtype, quantize=spec)
    out = tmp_path / f"q-{spec}-{str(dtype).removeprefix('torch.')}"
    quant_io.save_quantized(model, out, src)
    return model, out


def _buffers(model) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _same_model(a, b) -> None:
    ta, tb = _buffers(a), _buffers(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    assert quant.scheme_of(a) == quant.scheme_of(b)


def _greedy(model) -> list[list[int]]:
    gen = Generator(model, max_len=64, chunk_size=8, batch=1)
    return [gen.generate(p, 12, stop_at_eos=False) for p in PROMPTS]


@pytest.mark.parametrize(("spec", "dtype"), [("int8", torch.float32), ("int4", torch.float32),
                                             ("int4-g128", torch.bfloat16), ("int8", torch.bfloat16)])
def test_roundtrip_is_the_in_memory_model(tmp_path, monkeypatch, spec, dtype):
    model, out = _saved(tmp_path, spec, dtype)
    monkeypatch.setattr(quant, "quantize_int4", _never)  # loading must not quantize
    monkeypatch.setattr(quant, "quantize_int8", _never)
    loaded = load_model(out)
    assert loaded.dtype == dtype and isinstance(loaded.lm_head, quant.QuantLinear)  # the tied head's own copy
    _same_model(model, loaded)
    for got, want in zip(feed(loaded, ROWS, 8), feed(model, ROWS, 8), strict=True):
        assert torch.equal(got, want)
    assert _greedy(loaded) == _greedy(model)
    # Unjoined projections: the stored parts as they are, equal to the joined weight's row blocks.
    parts = load_model(out, fused_projections=False)
    a, b = model.layers[1].self_attn, parts.layers[1].self_attn
    codes, scales = (torch.split(t, list(a.sizes)) for t in (a.qkv_proj.weight.qweight, a.qkv_proj.weight.scales))
    assert torch.equal(b.q_proj.weight.qweight, codes[0]) and torch.equal(b.v_proj.weight.scales, scales[2])


def _never(*args, **kwargs):
    raise AssertionError("a quantized checkpoint was quantized again")


@pytest.mark.parametrize("spec", ["int8", "int4-g64"])
def test_roundtrip_untied_with_biases(tmp_path, spec):
    """An untied head (stored as lm_head's own tensors) and a bias on every projection (joined ones split)."""
    src = save(hf_llama(seed=3, bias=True), tmp_path / "float")
    model, out = _saved(tmp_path, spec, torch.float32, src)
    keys = load_file(out / quant_io.WEIGHTS_FILE).keys()
    assert {"lm_head.qweight", "model.layers.0.self_attn.k_proj.bias", "model.layers.1.mlp.up_proj.bias"} <= keys
    loaded = load_model(out)
    _same_model(model, loaded)
    for got, want in zip(feed(loaded, ROWS[:1], 4), feed(model, ROWS[:1], 4), strict=True):
        assert torch.equal(got, want)


def test_files_are_smaller_by_what_the_formats_hold(tmp_path):
    """The weights file is the quantized weights' bytes plus a small header, and int4 < int8 < float / 3."""
    sizes = {}
    for spec in ("int8", "int4"):
        model, out = _saved(tmp_path, spec)
        sizes[spec] = (out / quant_io.WEIGHTS_FILE).stat().st_size
        assert 0 < sizes[spec] - quant.weight_bytes(model) < 32_000, spec
    float_size = (default_model_path() / "model.safetensors").stat().st_size
    assert sizes["int4"] < sizes["int8"] < float_size / 3


def test_quantize_command_writes_a_checkpoint_generate_runs(tmp_path, capsys):
    from static_decode.commands import cli

    out = tmp_path / "int4"
    assert cli.main(["quantize", "--quantize", "int4", "--out", str(out), "-t", "1"]) == 0
    said = capsys.readouterr().out
    assert "as int4-g32" in said and "MB in" in said and "tokenizer.json" in said, said
    entry = json.loads((out / "config.json").read_text())["quantization"]
    assert entry == {"format": "static-decode", "scheme": "int4-g32", "bits": 4, "group": 32,
                     "layout": "int4-chunk64", "layout_version": 1, "dtype": "float32"}
    for name in ("tokenizer.json", "generation_config.json", quant_io.WEIGHTS_FILE):
        assert (out / name).is_file(), name
    assert not (out / "model.safetensors").exists()  # a reader that does not know the entry finds no weights

    argv = ["generate", "--prompt", "def f(", "--max-new-tokens", "12", "--temperature", "0", "-t", "1"]
    assert cli.main([*argv, "--quantize", "int4"]) == 0
    at_load = capsys.readouterr().out
    assert cli.main([*argv, "--model", str(out)]) == 0
    assert capsys.readouterr().out == at_load
    assert cli.main([*argv, "--model", str(out), "--quantize", "int4-g32"]) == 0  # its own scheme: a no-op
    assert capsys.readouterr().out == at_load
    assert cli.main([*argv, "--model", str(out), "--quantize", "int8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"static-decode generate: error: {out} is quantized as int4-g32 for float32; --quantize int8 "
                   "needs the float checkpoint (quantize it at load, or save it again with static-decode quantize)"]
    # perplexity loads it too, and says what it ran
    assert cli.main(["perplexity", "--model", str(out), "--tokens", "40", "-q", "-t", "1"]) == 0
    assert "float32 int4-g32" in capsys.readouterr().out

    # quantize refuses a quantized checkpoint and an --out that holds files, before loading anything
    assert cli.main(["quantize", "--model", str(out), "--quantize", "int8", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"static-decode quantize: error: {out} is quantized already (int4-g32); quantize its float checkpoint")
    assert cli.main(["quantize", "--quantize", "int8", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"static-decode quantize: error: --out {out} exists and is not an empty directory; choose a new one")


def _rewrite(out: Path, edit) -> None:
    file = out / quant_io.WEIGHTS_FILE
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_refusals_name_what_is_wrong(tmp_path):
    _, out = _saved(tmp_path, "int4")
    with pytest.raises(ValueError, match=r"quantized as int4-g32 for float32 \(its scales are rounded to it\); "
                                         r"--dtype bfloat16 needs"):
        load_model(out, dtype="bfloat16")
    load_model(out, dtype="float32", quantize="int4")  # its own dtype and scheme
    with pytest.raises(ValueError, match="its products run on the CPU or CUDA, not meta"):
        load_model(out, device="meta")

    key = "model.layers.2.mlp.down_proj.scales"
    _rewrite(out, lambda t: t.pop(key))
    with pytest.raises(KeyError, match=f"lacks tensor\\(s\\): {key}'"):
        load_model(out)
    _rewrite(out, lambda t: t.update({key: torch.ones(128, 11, 2)}))
    with pytest.raises(ValueError, match=rf"^tensor '{key}' in quantized.safetensors is F32 \(128, 11, 2\), the "
                                         r"config and the int4-g32 float32 layout need F32 \(128, 12, 2\)$"):
        load_model(out)
    bad = torch.ones(128, 12, 2)
    bad[5, 3, 0] = float("nan")
    _rewrite(out, lambda t: t.update({key: bad}))
    with pytest.raises(ValueError, match=f"tensor '{key}' in .* holds non-finite scales: the file is corrupt"):
        load_model(out)
    _rewrite(out, lambda t: t.update({"model.extra": torch.ones(1)}))
    with pytest.raises(KeyError, match="tensor\\(s\\) the config does not describe: model.extra"):
        load_model(out)

    file = out / quant_io.WEIGHTS_FILE
    file.write_bytes(file.read_bytes()[:-1000])  # cut short
    with pytest.raises(ValueError, match=f"^{file} is truncated or corrupt"):
        load_model(out)

    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 352}))  # inputs the layout cannot hold
    with pytest.raises(ValueError, match="^model.layers.0.mlp.down_proj.qweight: int4 takes a weight whose 352 "):
        load_model(out)
    cfg["quantization"]["layout_version"] = 2
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="key 'quantization': layout 'int4-chunk64' version 2; this static-decode "
                                         "reads int4-g32 as 'int4-chunk64' version 1"):
        load_model(out)


def test_save_refusals(tmp_path):
    floats = load_model(default_model_path())
    with pytest.raises(ValueError, match="the model is not quantized"):
        quant_io.save_quantized(floats, tmp_path / "a", default_model_path())
    assert not (tmp_path / "a").exists()
    model, out = _saved(tmp_path, "int8")
    with pytest.raises(ValueError, match="exists and is not an empty directory"):
        quant_io.save_quantized(model, out, default_model_path())
    with pytest.raises(ValueError, match="is a quantized checkpoint already"):
        quant_io.save_quantized(model, tmp_path / "b", out)
    other = save(hf_llama(seed=1), tmp_path / "other")
    with pytest.raises(ValueError, match="does not describe this model"):
        quant_io.save_quantized(model, tmp_path / "c", other)


# ---- tensor parallelism -----------------------------------------------------------------------------------------
def _dequantized(model) -> dict[str, torch.Tensor]:
    return {name: m.weight.dequantize() for name, m in model.named_modules() if isinstance(m, quant.QuantLinear)}


@pytest.mark.parametrize("spec", ["int8", "int4-g32", "int4-g64"])
def test_a_rank_reads_its_slices_of_the_saved_weights(tmp_path, spec):
    """Each rank's weights (unjoined, dequantized in float64) are exactly its rows or columns of the whole model's:
    int4's packed bytes and group scales slice in whole chunks."""
    _, out = _saved(tmp_path, spec)
    whole = _dequantized(load_model(out, fused_projections=False))
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        shard = _dequantized(load_model(out, tp=tp, fused_projections=False))
        assert shard.keys() == whole.keys()
        for name, w in whole.items():
            dim = shard_dim(f"{name}.weight")
            want = w if dim is None else w.narrow(dim, *_span(tp, w.shape[dim]))
            assert torch.equal(shard[name], want), name


def _span(tp: TensorParallel, total: int) -> tuple[int, int]:
    start, stop = tp.span(total)
    return start, stop - start


def test_a_world_size_that_splits_int4_groups_is_refused(tmp_path):
    """int4-g128: o_proj's 128 inputs over 2 ranks are 64 a rank, half a group."""
    _, out = _saved(tmp_path, "int4-g128")
    with pytest.raises(ValueError, match=r"^tensor-parallel world size 2 gives each rank 64 of "
                                         r"model.layers.0.self_attn.o_proj.qweight's 128 inputs, not whole int4 "
                                         r"chunks of 64 columns and groups of 128"):
        load_model(out, tp=TensorParallel(0, 2))


def _tp_rank(rank: int, world: int, port: int, out: Path, dest: Path) -> None:
    import torch.distributed as dist

    from tests.support import tp_worker

    torch.set_num_threads(1)
    open_group("gloo", rank, world, f"tcp://127.0.0.1:{port}")
    try:
        tp = TensorParallel(rank, world)
        model = load_model(out, tp=tp)
        at_load = load_model(default_model_path(), tp=tp, quantize="int8")  # int8: scales a max over the ranks
        same = all(torch.equal(a, b) for a, b in zip(_buffers(model).values(), _buffers(at_load).values(),
                                                     strict=True))
        with torch.no_grad():
            cache = model.new_cache(2, tp_worker.MAX_LEN)
            logits = [model(torch.tensor(t), cache, n) for t, n in tp_worker.FORWARD_CHUNKS]
        tokens = Generator(model, max_len=tp_worker.MAX_LEN, chunk_size=tp_worker.CHUNK).generate(
            tp_worker.PROMPTS, tp_worker.NEW_TOKENS, stop_at_eos=False)
        torch.save({"same": same, "logits": logits, "tokens": tokens}, dest / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_on_a_saved_checkpoint(tmp_path):
    """Each rank's shard of the saved int8 checkpoint equals the one quantizing at load gives (tensor by tensor),
    and the ranks' all-reduced logits and greedy tokens are the single process's."""
    import torch.multiprocessing as mp

    from tests.support import tp_worker

    single, out = _saved(tmp_path, "int8")
    mp.spawn(_tp_rank, args=(2, tp_worker.free_port(), out, tmp_path), nprocs=2, join=True)
    with torch.no_grad():
        cache = single.new_cache(2, tp_worker.MAX_LEN)
        logits = [single(torch.tensor(t), cache, n) for t, n in tp_worker.FORWARD_CHUNKS]
    tokens = Generator(single, max_len=tp_worker.MAX_LEN, chunk_size=tp_worker.CHUNK).generate(
        tp_worker.PROMPTS, tp_worker.NEW_TOKENS, stop_at_eos=False)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert got["same"], rank
        assert got["tokens"] == tokens, rank
        for a, b in zip(got["logits"], logits, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("spec", "dtype", "hidden"), [("q8_0", torch.float32, None), ("q8_0", torch.bfloat16, None),
                                                       ("q4_k", torch.float32, 256), ("q6_k", torch.bfloat16, 256)])
def test_gguf_blocks_roundtrip_to_the_in_memory_model(tmp_path, monkeypatch, spec, dtype, hidden):
    """GGUF blocks quantized from a float checkpoint (--quantize q4_k ...) saved as their bytes and loaded as them:
    an untied head with biases where the model is 256 wide (the K-quants' blocks)."""
    from static_decode.model.gguf_quant import BlockLinear, Blocks

    src = None if hidden is None else save(hf_llama(seed=5, bias=True, hidden=hidden, vocab=128), tmp_path / "float")
    model, out = _saved(tmp_path, spec, dtype, src)
    monkeypatch.setattr(quant, "quantize_blocks", _never)  # loading must not quantize
    loaded = load_model(out)
    assert loaded.quantization == Blocks((spec.upper(),)) and isinstance(loaded.lm_head, BlockLinear)
    _same_model(model, loaded)
    for got, want in zip(feed(loaded, ROWS, 8), feed(model, ROWS, 8), strict=True):
        assert torch.equal(got, want)
    assert _greedy(loaded) == _greedy(model)
    assert json.loads((out / "config.json").read_text())["quantization"]["scheme"] == spec
