"""The layers of the code, read from the source with `ast`: arrows point down only, and no import cycles.

    core (static_decode: config, cache, attention, ...)  <-  capture/  <-  the generator  <-  the commands

Every import counts, also one inside a function or under `if TYPE_CHECKING:`. A module that is in no layer
fails the test: a new module is placed on purpose. The checker itself is tested on a planted tree.
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
CORE = {
    f"static_decode.{name}"
    for name in ("attention", "cache", "chat_template", "checks", "config", "cpu_kernel", "exports", "fused_decode",
                 "hugepages",
                 "loading", "memory", "model", "quant", "quant_cuda", "quant_io",
                 "parallel", "progress", "projection", "ranges", "reference", "rope", "sampling", "speculation",
                 "split_attention", "steps", "stop_strings", "verify")
}
GENERATOR = {"static_decode", "static_decode.conversation", "static_decode.generator", "static_decode.prefix_cache",
             "static_decode.request",
             "static_decode.speculative_loop", "static_decode.stats"}
LAYER_NAMES = ("core", "capture", "generator", "commands")


def layer_of(module: str) -> int | None:
    """0 core, 1 capture, 2 generator (and the package's public namespace), 3 commands; None: unplaced."""
    if module in CORE:
        return 0
    if module == "capture" or module.startswith("capture."):
        return 1
    if module in GENERATOR:
        return 2
    if module == "static_decode.__main__" or module.startswith("static_decode.commands"):
        return 3
    return None


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
    out = [f"{m} is in no layer (place it in tests/test_layers.py)" for m in mods if layer_of(m) is None]
    for m, targets in sorted(edges.items()):
        for t in sorted(targets):
            lm, lt = layer_of(m), layer_of(t)
            if lm is not None and lt is not None and lt > lm:
                out.append(f"{m} ({LAYER_NAMES[lm]}) imports {t} ({LAYER_NAMES[lt]}), a layer above it")
    out += [f"import cycle: {' <-> '.join(c)}" for c in cycles(edges)]
    return out


def test_the_project_has_no_upward_import_and_no_cycle() -> None:
    assert violations(ROOT) == []


def test_every_layer_is_populated() -> None:
    layers = {layer_of(m) for m in modules(ROOT)}
    assert layers == {0, 1, 2, 3}


def _plant(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_checker_finds_planted_violations(tmp_path: Path) -> None:
    _plant(tmp_path, {
        "static_decode/__init__.py": "",
        # upward, inside a function
        "static_decode/cache.py": "def f():\n    from static_decode.generator import Generator\n",
        "static_decode/generator.py": "from static_decode import cache\n",
        "static_decode/attention.py": "if TYPE_CHECKING:\n    import capture.runner\n",
        "static_decode/rope.py": "from .model import x\n",  # a relative import, into a cycle
        "static_decode/model.py": "from static_decode.rope import y\n",
        "static_decode/newthing.py": "",
        "capture/__init__.py": "",
        "capture/runner.py": "from static_decode.commands.cli import main\n",
        "static_decode/commands/__init__.py": "",
        "static_decode/commands/cli.py": "import capture.runner\n",
    })
    found = violations(tmp_path)
    assert "static_decode.newthing is in no layer (place it in tests/test_layers.py)" in found
    assert "static_decode.cache (core) imports static_decode.generator (generator), a layer above it" in found
    assert "static_decode.attention (core) imports capture.runner (capture), a layer above it" in found
    assert "capture.runner (capture) imports static_decode.commands.cli (commands), a layer above it" in found
    assert "import cycle: static_decode.model <-> static_decode.rope" in found
    assert "import cycle: static_decode.cache <-> static_decode.generator" in found
    assert "import cycle: capture.runner <-> static_decode.commands.cli" in found
    assert len(found) == 7


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["bench", "--help"], ["capture-report", "-h"]])
def test_help_does_not_load_the_compiler(argv: list[str]) -> None:
    code = (
        "import sys\nfrom static_decode.commands.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        "print('DYNAMO', 'torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip().endswith("DYNAMO False"), out[-500:]
