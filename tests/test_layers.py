"""The layers of the code, read from the source with `ast`: arrows point down only, and no import cycles.

    base, text <- kernels <- core <- model <- checkpoints <- steps <- capture/ <- generation <- commands

Each folder of static_decode/ is one layer (LAYERS, bottom first): a module may import its own folder and the
folders below, never one above, and the layer of a module is its folder's, so a new file needs no edit here. A
module outside every folder fails the test. Every import counts, also one inside a function or under
`if TYPE_CHECKING:`. The checker itself is tested on a planted tree.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("static_decode", "capture")
# (prefix, layer name), bottom first; the longest prefix that names a module or its package decides
LAYERS = (
    ("static_decode.base", "base"),
    ("static_decode.text", "text"),
    ("static_decode.kernels", "kernels"),
    ("static_decode.core", "core"),
    ("static_decode.model", "model"),
    ("static_decode.checkpoints", "checkpoints"),
    ("static_decode.steps", "steps"),
    ("capture", "capture"),
    ("static_decode.generation", "generation"),
    ("static_decode", "generation"),  # the package's public namespace: lazy names of every layer
    ("static_decode.commands", "commands"),
    ("static_decode.__main__", "commands"),
)
# layers with nothing between them: neither may import the other (base and text share the bottom)
RANK = {"base": 0, "text": 0, "kernels": 1, "core": 2, "model": 3, "checkpoints": 4, "steps": 5, "capture": 6,
        "generation": 7, "commands": 8}


def layer_of(module: str) -> str | None:
    """The layer name of a module (its folder's), None when it is in none."""
    best = None
    for prefix, name in LAYERS:
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, name)
    if best is None or (best[0] == "static_decode" and module != "static_decode"):
        return None  # a module directly in static_decode/ belongs to no folder
    return best[1]


def modules(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            out[".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")] = f
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in the file)."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        package = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, up level - 1
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                # `from pkg import sub` imports the module pkg.sub when there is one, else a name of pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                r = resolve(t)
                if r is not None and r != m:
                    edges[m].add(r)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def violations(root: Path) -> list[str]:
    mods = modules(root)
    edges = imports(mods)
    out = [f"{m} is in no layer (put it in a folder of static_decode/)" for m in mods if layer_of(m) is None]
    for m, targets in sorted(edges.items()):
        for t in sorted(targets):
            lm, lt = layer_of(m), layer_of(t)
            if lm is None or lt is None or lm == lt:
                continue
            if RANK[lt] >= RANK[lm]:
                out.append(f"{m} ({lm}) imports {t} ({lt}), a layer {'above' if RANK[lt] > RANK[lm] else 'beside'} it")
    out += [f"import cycle: {' <-> '.join(c)}" for c in cycles(edges)]
    return out


def test_the_project_has_no_upward_import_and_no_cycle() -> None:
    assert violations(ROOT) == []


def test_every_layer_is_populated_and_every_folder_is_a_layer() -> None:
    assert {layer_of(m) for m in modules(ROOT)} == set(RANK)
    folders = {p.parent.relative_to(ROOT).parts[1] for p in (ROOT / "static_decode").glob("*/__init__.py")}
    assert folders == {prefix.split(".")[1] for prefix, _ in LAYERS if prefix.count(".") == 1 and
                       not prefix.endswith("__main__")}


def _plant(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_checker_finds_planted_violations(tmp_path: Path) -> None:
    _plant(tmp_path, {
        "static_decode/__init__.py": "",
        "static_decode/core/__init__.py": "",
        "static_decode/generation/__init__.py": "",
        "static_decode/model/__init__.py": "",
        "static_decode/base/__init__.py": "",
        "static_decode/text/__init__.py": "",
        # upward, inside a function
        "static_decode/core/cache.py": "def f():\n    from static_decode.generation.generator import Generator\n",
        "static_decode/generation/generator.py": "from static_decode.core import cache\n",
        "static_decode/core/attention.py": "if TYPE_CHECKING:\n    import capture.runner\n",
        "static_decode/model/rope.py": "from .llama import x\n",  # a relative import, into a cycle
        "static_decode/model/llama.py": "from static_decode.model.rope import y\n",
        "static_decode/base/checks.py": "from static_decode.text import chat_template\n",  # beside: same rank
        "static_decode/text/chat_template.py": "",
        "static_decode/newthing.py": "",
        "capture/__init__.py": "",
        "capture/runner.py": "from static_decode.commands.cli import main\n",
        "static_decode/commands/__init__.py": "",
        "static_decode/commands/cli.py": "import capture.runner\n",
    })
    found = violations(tmp_path)
    assert "static_decode.newthing is in no layer (put it in a folder of static_decode/)" in found
    assert ("static_decode.core.cache (core) imports static_decode.generation.generator (generation), a layer above "
            "it") in found
    assert "static_decode.core.attention (core) imports capture.runner (capture), a layer above it" in found
    assert "capture.runner (capture) imports static_decode.commands.cli (commands), a layer above it" in found
    assert ("static_decode.base.checks (base) imports static_decode.text.chat_template (text), a layer beside "
            "it") in found
    assert "import cycle: static_decode.model.llama <-> static_decode.model.rope" in found
    assert "import cycle: static_decode.core.cache <-> static_decode.generation.generator" in found
    assert "import cycle: capture.runner <-> static_decode.commands.cli" in found
    assert len(found) == 8, found


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["bench", "--help"], ["capture-report", "-h"]])
def test_help_does_not_load_the_compiler(argv: list[str]) -> None:
    code = (
        "import sys\nfrom static_decode.commands.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        "print('DYNAMO', 'torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip().endswith("DYNAMO False"), out[-500:]


def test_profiles_import_each_other_in_no_cycle() -> None:
    """profiles/ scripts import one another by bare name (the folder is on sys.path): no circle among them."""
    files = {f.stem: f for f in sorted((ROOT / "profiles").glob("*.py"))}
    edges: dict[str, set[str]] = {m: set() for m in files}
    for m, f in files.items():
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
            edges[m] |= {n for n in names if n in files and n != m}
    assert any(edges.values())  # the checker sees the imports at all
    assert cycles(edges) == []


def test_the_tests_mirror_the_package_folders() -> None:
    """Each folder of tests/ is named after a folder of the code (static_decode/<x>, capture, profiles, and
    commands' own bench/ and serve/), but support/, which holds the shared helpers and is no test module's home;
    the project-wide checks (this file, the docs, the wheel, no hang) sit at the top."""
    package = ROOT / "static_decode"
    code = {p.parent.relative_to(package).as_posix() for p in package.rglob("__init__.py")}
    code |= {"capture", "profiles"}
    tests = {p.parent.relative_to(ROOT / "tests").as_posix() for p in (ROOT / "tests").rglob("__init__.py")} - {"."}
    assert "support" in tests and not list((ROOT / "tests" / "support").glob("test_*.py"))
    assert tests - {"support"} <= code, sorted(tests - {"support"} - code)
    top = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    assert top == {"test_layers.py", "test_docs.py", "test_wheel.py", "test_no_hang.py"}, sorted(top)
