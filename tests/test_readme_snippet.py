"""README's Python snippet, run as written on the embedded model (its path, the CPU and shorter caches put in; the
rest word for word, float32), and what it claims: the speculative Generator's greedy output is the plain one's
(`same`); the ragged batch runs on a Generator of two rows while `gen` keeps one row
(so its one-prompt requests stay on the one-row steps)."""

from __future__ import annotations

import re
from pathlib import Path

from static_decode.checkpoints.loading import default_model_path

ROOT = Path(__file__).resolve().parents[1]


def snippet() -> str:
    text = (ROOT / "README.md").read_text().split("## The Python API at a glance", 1)[1]
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_the_readme_snippet_does_what_it_says():
    dtype = "float32"  # where `same` is claimed True (bfloat16: up to near-ties, which a test cannot pin)
    code = snippet()
    for old, new in (('"path/to/checkpoint"', repr(str(default_model_path()))), ('device="cuda"', 'device="cpu"'),
                     ('dtype="bfloat16"', f'dtype="{dtype}"'), ("max_len=8192", "max_len=256"),
                     ("max_len=2048", "max_len=128"), ("print(gen.stats.summary())", "gen.stats.summary()")):
        assert old in code, old
        code = code.replace(old, new)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert len(scope["rows"]) == 2 and scope["batch"].cache.batch == 2 and scope["gen"].cache.batch == 1
    assert len(scope["ids"]) > 0
    assert scope["same"] is True
