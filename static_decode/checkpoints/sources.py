"""What a --model value names: a save_pretrained directory, a GGUF file, or a Hugging Face Hub id.

One resolution for every command and for `load_model` / `load_tokenizer`: a path that exists wins (a directory is a
checkpoint, a file must be .gguf), a path ending in .gguf is a GGUF file, and `org/name[@revision]` otherwise is
looked up in the local Hub cache (static_decode.checkpoints.hub), which gives a directory or a GGUF file.
"""

from __future__ import annotations

from pathlib import Path

from static_decode.checkpoints.gguf import is_gguf
from static_decode.checkpoints.hub import is_hub_id, resolve_hub

FORMS = "a checkpoint directory, a .gguf file or a Hub id (org/name[@revision])"


def resolve_model(spec: str | Path) -> Path:
    """The checkpoint directory or GGUF file `spec` names; a value that names neither is refused in one line."""
    text = str(spec)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if is_gguf(path):
            return path
        raise ValueError(f"{path} is a file, not a .gguf file; a model is {FORMS}")
    if is_gguf(text):
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    if is_hub_id(text):
        return resolve_hub(text)
    raise FileNotFoundError(f"no checkpoint at {path}: it does not exist (a model is {FORMS})")
