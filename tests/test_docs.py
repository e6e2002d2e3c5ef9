"""The documentation's links resolve: every relative link in README.md, docs/*.md and profiles/*.md names a file
that exists, and a link to a heading (`file.md#anchor`) names a heading that file has (GitHub's anchor rules).
README.md stays a front page: under 250 lines, and its test command is the one CI runs (.ci/run). README's Python
snippet, run on the embedded model (its path, the CPU, float32, shorter caches and eager steps put in; the rest word
for word; compiled speculation's equality is tests/steps/test_speculation.py's), does what it says: the
speculative Generator's greedy output is the plain one's (`same`), and the ragged batch runs on a Generator of two
rows while `gen` keeps one row (its one-prompt requests stay on one-row steps)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from static_decode.checkpoints.loading import default_model_path

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "profiles").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def links(page: Path) -> list[str]:
    """The link targets of a page, outside code blocks."""
    return LINK.findall(FENCE.sub("", page.read_text()))


def anchors(page: Path) -> set[str]:
    """The heading anchors GitHub makes for a Markdown page: lower case, punctuation dropped, spaces to hyphens,
    a repeated anchor numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_pages_found():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/guide.md", "docs/performance.md", "profiles/RESULTS.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_anchor_rules():
    page = ROOT / "docs" / "performance.md"
    assert "gpu-one-h200-llama-31-8b-shape-2026-11-30" in anchors(page)


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 250, f"README.md has {len(lines)} lines; move detail into docs/"


def test_readme_test_command_is_the_ci_one():
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.startswith("python3 -m venv")]
    assert len(ci) == 1
    assert ci[0] in (ROOT / "README.md").read_text()


def test_architecture_names_every_folder_and_module():
    """docs/architecture.md's layer diagram, drawn from the tree: every module it names exists in the folder it
    names, and every folder and module of the packages is named."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    diagram = text.split("## The layers", 1)[1].split("```")[1]
    named: dict[str, set[str]] = {}
    folder = None
    for line in diagram.splitlines():
        m = re.search(r"((?:static_decode|capture)/[a-z_/]*)", line)
        if m:
            folder = m.group(1).rstrip("/")
            line = line[m.end():]
        if folder is None:
            continue
        words = re.findall(r"\b([a-z_][a-z0-9_]*)\b", line.split(":", 1)[-1].split("(")[0])
        named.setdefault(folder, set()).update(words)
    real: dict[str, set[str]] = {}
    for init in sorted([*(ROOT / "static_decode").rglob("__init__.py"), ROOT / "capture" / "__init__.py"]):
        d = init.parent.relative_to(ROOT).as_posix()
        if d != "static_decode":
            real[d] = {f.stem for f in init.parent.glob("*.py") if f.stem != "__init__"}
    assert set(named) == set(real), (set(named) ^ set(real))
    for d, mods in real.items():
        assert mods <= named[d], (d, mods - named[d])
        listed = {w for w in named[d] if (ROOT / d / f"{w}.py").exists()}
        assert listed == mods, (d, listed ^ mods)


def snippet() -> str:
    text = (ROOT / "README.md").read_text().split("## The Python API at a glance", 1)[1]
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_the_readme_snippet_does_what_it_says():
    dtype = "float32"  # where `same` is claimed True (bfloat16: up to near-ties, which a test cannot pin)
    code = snippet()
    for old, new in (('"path/to/checkpoint"', repr(str(default_model_path()))), ('device="cuda"', 'device="cpu"'),
                     ('dtype="bfloat16"', f'dtype="{dtype}"'), ("max_len=8192", "max_len=128"),
                     ("max_len=2048", "max_len=64"), ("print(gen.stats.summary())", "gen.stats.summary()"),
                     ("compile=True", "compile=False")):
        assert old in code, old
        code = code.replace(old, new)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert len(scope["rows"]) == 2 and scope["batch"].cache.batch == 2 and scope["gen"].cache.batch == 1
    assert len(scope["ids"]) > 0
    assert scope["same"] is True
