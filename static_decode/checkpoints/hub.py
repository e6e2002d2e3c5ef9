"""A Hugging Face Hub id (`org/name`, or `org/name@revision`) resolved to its files in the local Hub cache.

Resolution is offline: `huggingface_hub.snapshot_download(..., local_files_only=True)` finds the snapshot the cache
holds for the revision (a branch such as `main` through the cache's refs, or a commit), wherever the cache lives
(HF_HUB_CACHE, HF_HOME, as huggingface_hub reads them). Nothing is downloaded here: a model missing from the cache
is refused in one line naming it and the command that fetches it, so loading never waits on the network.

A snapshot holding config.json is a save_pretrained checkpoint; one holding a single .gguf file (and no
config.json) is that file; several .gguf files are refused, naming them, since the id does not say which.
"""

from __future__ import annotations

from pathlib import Path

from static_decode.checkpoints.gguf import SUFFIX


def is_hub_id(spec: str | Path) -> bool:
    """True when `spec` reads as a Hub id rather than a path: `org/name[@revision]`, one slash, no .gguf suffix,
    not absolute or relative to . / ~, and nothing at that path on disk (a local directory wins)."""
    text = str(spec)
    if Path(text).exists() or text.startswith(("/", ".", "~")) or text.lower().endswith(SUFFIX):
        return False
    repo = text.split("@", 1)[0]
    if repo.count("/") != 1:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError:
        return False
    return True


def _fetch_hint(repo: str, revision: str | None) -> str:
    return f"hf download {repo}" + (f" --revision {revision}" if revision else "")


def resolve_hub(spec: str | Path) -> Path:
    """The checkpoint directory or GGUF file a Hub id names in the local cache (see the module docstring)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    text = str(spec)
    repo, _, revision = text.partition("@")
    revision = revision or None
    try:
        root = Path(snapshot_download(repo, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, HfHubHTTPError, FileNotFoundError):
        raise FileNotFoundError(f"Hub model {text!r} is not in the local Hugging Face cache "
                                f"({constants.HF_HUB_CACHE}) and no local path {text} exists; fetch it first: "
                                f"{_fetch_hint(repo, revision)}") from None
    except HFValidationError as e:
        raise ValueError(f"{text!r} is not a Hub id (org/name or org/name@revision): {e}") from None
    if (root / "config.json").is_file():
        return root
    ggufs = sorted(p for p in root.iterdir() if p.name.lower().endswith(SUFFIX))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        raise ValueError(f"Hub model {text!r} holds {len(ggufs)} GGUF files ({', '.join(p.name for p in ggufs)}); "
                         f"pass one by its path, e.g. {ggufs[0]}")
    raise FileNotFoundError(f"Hub model {text!r} (cached at {root}) has no config.json and no .gguf file")
