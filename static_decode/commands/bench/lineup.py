"""Which systems one `static-decode bench` run builds from its weight forms, what each is called, and what its
weights weigh (the bytes floor of static_decode.commands.bench.report counts each system's own).

One model per `--quantize` form with every own-model system on it ("static-decode int8"), one llama.cpp system per
`--gguf` file ("llama.cpp Q8_0"); a single form or file keeps the plain names. Naming and byte counting in full:
docs/internals.md#bench-lineup.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from static_decode.base.hugepages import huge_page_share
from static_decode.checkpoints.loading import load_model
from static_decode.commands.bench.config import BenchConfig, GGUFFile
from static_decode.commands.bench.requests import FORMS, system_name
from static_decode.model.llama import Llama
from static_decode.model.quant import read_bytes

# the systems that run static-decode's own model: one per weight form
OWN_MODEL = ("static-decode", "static-decode-lookup", "static-decode-eager", "full-read", "concat")


@dataclass(frozen=True)
class GGUFFacts:
    """What llama.cpp reads from a GGUF's header: its quant type's name and its tensors' bytes."""

    file_type: str | None  # "Q8_0", "Q4_K_M", "BF16", "F32"; None: not recorded in the file
    tensor_bytes: int
    counted: str  # how tensor_bytes was counted


def file_type_name(code: int) -> str:
    """llama.cpp's name of a `general.file_type` code, from llama-cpp-python's LLAMA_FTYPE_* constants
    (7 -> "Q8_0", 15 -> "Q4_K_M", 0 -> "F32"); the code itself when this release does not know it."""
    import llama_cpp

    for attr in dir(llama_cpp):
        if attr.startswith("LLAMA_FTYPE_") and getattr(llama_cpp, attr) == code:
            return attr.removeprefix("LLAMA_FTYPE_").removeprefix("MOSTLY_").removeprefix("ALL_")
    return f"file_type {code}"


def read_gguf(path: Path) -> GGUFFacts:
    """The GGUF's quant type and tensor bytes as llama.cpp reads them: the model opened with its vocabulary only
    (no weights read), llama.cpp's log silenced meanwhile. Without llama-cpp-python: no type, the file's size.
    A file llama.cpp cannot open is a ValueError naming it."""
    if importlib.util.find_spec("llama_cpp") is None:
        return GGUFFacts(None, path.stat().st_size, "file size (tensors and metadata)")
    import llama_cpp

    log = logging.getLogger("llama-cpp-python")  # the logger llama-cpp-python's log callback consults
    level = log.level
    log.setLevel(logging.CRITICAL + 1)
    try:
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    finally:
        log.setLevel(level)
    if not model:
        raise ValueError(f"--gguf {path}: llama.cpp cannot open it as a GGUF model")
    try:
        buf = ctypes.create_string_buffer(32)
        n = llama_cpp.llama_model_meta_val_str(model, b"general.file_type", buf, len(buf))
        code = buf.value.decode() if n > 0 else ""
        file_type = file_type_name(int(code)) if code.isdigit() else None
        size = int(llama_cpp.llama_model_size(model))
    finally:
        llama_cpp.llama_model_free(model)
    unread = embedding_unread(path)
    if unread:
        return GGUFFacts(file_type, size - unread, "llama_model_size (GGUF tensor bytes) less the embedding "
                                                   "but one row (the head has its own weights)")
    return GGUFFacts(file_type, size, "llama_model_size (GGUF tensor bytes)")


def embedding_unread(path: Path) -> int:
    """Bytes of the GGUF's token_embd a decode step does not read: all but one row where an `output.weight` (an
    untied head) is there, as static_decode.model.quant.read_bytes counts; 0 for a tied head (token_embd is the
    head, read whole). Its tensor table is read with the `gguf` package (no data is read)."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    embed = tensors.get("token_embd.weight")
    if embed is None or "output.weight" not in tensors:
        return 0
    rows = int(embed.shape[-1])  # GGUF lists dims innermost first: (hidden, vocab)
    return int(embed.n_bytes) - int(embed.n_bytes) // rows


@dataclass(frozen=True)
class Planned:
    """One system of the run: its kind (a name of bench_systems.SYSTEMS), its name in the tables and JSON, the
    weight form it runs (OWN_MODEL kinds) or its GGUF (llama.cpp), and whose tokens its tokens are compared with."""

    kind: str
    name: str
    reference: str
    form: str | None = None
    gguf: GGUFFile | None = None
    facts: GGUFFacts | None = None
    skip: str = ""  # why it is skipped before it is built ("": built)
    request: str = "greedy"  # the request form a static-decode system is timed with (bench.requests.FORMS)


# the concat baseline multiplies by the float matrices (attention's qkv_weights): no quantized form
CONCAT_FLOAT_ONLY = "skipped: the concat baseline (bench/baselines.py) multiplies by float weights only"


def own_name(kind: str, form: str, forms: tuple[str, ...]) -> str:
    """"static-decode int8"; a GGUF file's form by its label ("static-decode Q4_K_M"); plain for one form."""
    return kind if len(forms) == 1 or form == "none" else f"{kind} {form.removeprefix('gguf:')}"


def gguf_names(files: tuple[GGUFFile, ...], facts: dict[Path, GGUFFacts]) -> list[str]:
    """Each file's llama.cpp system name: NAME=, else its quant type, else its file name; a type two files share
    gets the file name too; one unnamed file is plain "llama.cpp"."""
    if len(files) == 1 and files[0].name is None:
        return ["llama.cpp"]
    labels = [f.name or (facts[f.path].file_type if f.path in facts else None) or f.path.name for f in files]
    return [f"llama.cpp {label}" + (f" ({f.path.name})" if labels.count(label) > 1 and not f.name else "")
            for f, label in zip(files, labels, strict=True)]


def plan(config: BenchConfig, facts: dict[Path, GGUFFacts]) -> list[Planned]:
    """The run's systems in order: --systems' order, each OWN_MODEL kind once per form, llama.cpp once per GGUF
    (once, to be skipped with a note, without one). Tokens are compared with static-decode's of the same form,
    and the systems without a form with static-decode's of the first form."""
    forms = config.forms
    first = own_name("static-decode", forms[0], forms)
    out = []
    for kind in config.systems:
        if kind == "static-decode":
            for f in forms:
                base = own_name(kind, f, forms)
                out += [Planned(kind, system_name(base, r), base if FORMS[r].greedy else "", form=f, request=r)
                        for r in config.requests]
        elif kind in OWN_MODEL:
            out += [Planned(kind, own_name(kind, f, forms), own_name("static-decode", f, forms), form=f,
                            skip=CONCAT_FLOAT_ONLY if kind == "concat" and f != "none" else "") for f in forms]
        elif kind == "llama.cpp" and config.gguf:
            names = gguf_names(config.gguf, facts)
            out += [Planned(kind, n, first, gguf=g, facts=facts.get(g.path))
                    for n, g in zip(names, config.gguf, strict=True)]
        else:
            out.append(Planned(kind, kind, first))
    return out


def load_forms(path: Path, config: BenchConfig, device: torch.device, tp: Any) -> dict[str, Llama]:
    """static-decode's model once per form, in --quantize's order (only the first where no OWN_MODEL system runs:
    the prompt and the model facts still come from it)."""
    forms = config.forms if any(k in OWN_MODEL for k in config.systems) else config.forms[:1]
    models = {}
    files = config.gguf_forms()
    for f in forms:
        if f in files:  # the GGUF file itself, its blocks as stored
            models[f] = load_model(files[f], dtype=config.dtype, device=device, tp=tp)
        else:
            models[f] = load_model(path, dtype=config.dtype, device=device, tp=tp, quantize=None if f == "none" else f)
        models[f].kv_dtype = config.kv_dtype
    return models


def _hf_read_bytes(model: Any) -> int:
    """A transformers model's parameter bytes (a tied tensor once), less the embedding but one row where the head
    has weights of its own (a step looks up one row): the rule of static_decode.model.quant.read_bytes."""
    total = sum(p.nbytes for p in model.parameters())
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return total if head is embed else total - embed.nbytes + embed[0].nbytes


def weights(p: Planned, system: Any, model: Llama) -> dict[str, Any]:
    """The system's JSON facts of its weights: its form and the bytes a decode step reads, with how they are
    counted (absent where unknown)."""
    if p.form is not None:
        share = huge_page_share(next(model.parameters()).data_ptr()) if model.device.type == "cpu" else None
        return {"quantize": p.form, "weight_bytes": read_bytes(model),
                "weight_bytes_counted": "static_decode.model.quant.read_bytes",
                **({} if share is None else {"weights_on_huge_pages": round(share, 3)})}
    if p.facts is not None:
        return {"gguf": str(p.gguf.path), "file_type": p.facts.file_type, "weight_bytes": p.facts.tensor_bytes,
                "weight_bytes_counted": p.facts.counted}
    if p.kind == "transformers" and system is not None:
        return {"weight_bytes": _hf_read_bytes(system.model),
                "weight_bytes_counted": "transformers parameters (embedding: one row unless it is the head)"}
    return {}
