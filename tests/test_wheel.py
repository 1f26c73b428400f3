"""The package as a stranger installs it: the wheel `python -m build` makes, in a venv that has no checkout,
its console scripts run from a folder outside the repository, the license inside its metadata.

The venv is fresh for dalifeed (the wheel installed with --no-deps into an empty venv, no PYTHONPATH, cwd
outside the checkout) but borrows torch, DALI and the rest through a .pth naming the shared venv's
site-packages: installing them again would take minutes and gigabytes and test pip, not the wheel. Files
named in such a .pth come after the venv's own site-packages on sys.path, so the wheel's dalifeed wins."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from helpers import convert, write_imagefolder

ROOT = Path(__file__).resolve().parent.parent


def build_wheel(tmp_path: Path) -> Path:
    """The wheel built from a copy of the files the build reads, so no build/ or egg-info lands in the checkout."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "dalifeed", src / "dalifeed", ignore=shutil.ignore_patterns("__pycache__"))
    # --no-isolation: the build uses this venv's setuptools instead of downloading one
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "dist"),
                    str(src)], check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("dalifeed-*.whl")
    return wheel


def fresh_venv(tmp_path: Path, wheel: Path) -> Path:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, capture_output=True, text=True, timeout=300)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "shared-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return venv


def test_the_wheel_installs_and_its_commands_run_without_the_checkout(tmp_path):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert "dalifeed-0.1.0.dist-info/licenses/LICENSE" in names
        assert "Apache License" in z.read("dalifeed-0.1.0.dist-info/licenses/LICENSE").decode()
        metadata = z.read("dalifeed-0.1.0.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata and "Project-URL: Source," in metadata
    assert not [n for n in names if n.startswith("tests/")]

    venv = fresh_venv(tmp_path, wheel)
    shards = tmp_path / "shards"
    convert(write_imagefolder(tmp_path / "images", {"a": 5, "b": 4}), shards, samples_per_shard=4)
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def run(*args) -> subprocess.CompletedProcess:
        return subprocess.run([str(a) for a in args], cwd=away, env=env, capture_output=True, text=True, timeout=300)

    where = run(venv / "bin" / "python", "-c", "import dalifeed; print(dalifeed.__file__)")
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout
    verify = run(venv / "bin" / "shard-convert", "verify", shards)
    assert verify.returncode == 0, verify.stderr
    doctor = run(venv / "bin" / "dalifeed", "doctor")
    assert doctor.returncode in (0, 1), doctor.stderr  # 1: a GPU node whose stack does not fit the driver
    assert "verdict:" in doctor.stdout and str(venv / "bin" / "python") in doctor.stdout
