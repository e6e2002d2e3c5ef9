"""The wheel holds everything the commands need: it is built from pyproject.toml here, unpacked into a temporary
folder and run from there (not from the source checkout): `static-decode --help`, and `bench --systems concat`,
whose baseline, default model and texts must all be inside the package. Every package folder of the source tree
is in the wheel, and so are the kernels' sources."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory) -> Path:
    """The wheel of a copy of the tracked files (the build leaves build/ and egg-info where it runs), unpacked."""
    out, src = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("source")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.splitlines()
    for name in listed:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, capture_output=True, text=True, timeout=600)
    (wheel,) = out.glob("static_decode-*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(out / "site")
    return out / "site"


def _run(site: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site), "STATIC_DECODE_CPU_KERNEL": "0", "OMP_NUM_THREADS": "1"}
    code = ("import sys, static_decode; assert static_decode.__file__.startswith(sys.argv[1]), static_decode.__file__\n"
            "from static_decode.commands.cli import main\nsys.exit(main(sys.argv[2:]))")
    return subprocess.run([sys.executable, "-c", code, str(site), *argv], cwd=site.parent, env=env,
                          capture_output=True, text=True, timeout=600)


def test_every_package_and_the_kernel_sources_are_in_the_wheel(unpacked):
    src = {p.parent.relative_to(ROOT) for p in [*(ROOT / "static_decode").rglob("__init__.py"),
                                                 *(ROOT / "capture").rglob("__init__.py")]}
    assert {d for d in src if (unpacked / d / "__init__.py").is_file()} == src
    for f in [*(ROOT / "static_decode" / "kernels" / "csrc").iterdir(), *(ROOT / "capture" / "baselines").iterdir()]:
        assert (unpacked / f.relative_to(ROOT)).is_file(), f
    assert (unpacked / "static_decode" / "default_model" / "config.json").is_file()


def test_the_commands_run_from_the_wheel(unpacked):
    run = _run(unpacked, "--help")
    assert run.returncode == 0 and "bench" in run.stdout, run.stderr[-2000:]
    run = _run(unpacked, "bench", "--systems", "concat,static-decode-eager", "--contexts", "5", "--max-len", "24",
               "--steps", "2", "--repeats", "1", "--warmup", "0", "--no-attention", "--threads", "1", "--quiet")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "concat" in run.stdout and "skipped" not in run.stdout.split("systems")[-1], run.stdout[-3000:]
