"""The wheel runs anywhere: built from the checkout, installed into a fresh virtualenv, and run from a folder
outside the checkout with no checkout on ``sys.path``, the quick start completes through both entry points."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

# what the wheel is built from: the files setup.py and pyproject.toml read (a copy, so the build leaves no build/
# folder in the checkout)
SOURCES = ("pyproject.toml", "setup.py", "README.md", "conf", "jobs", "parallel", "shardgen")
PROMPTS = ["a red fox in the snow", "a lighthouse at dusk", "a bowl of ramen", "a paper boat on a pond"]


def outside_env() -> dict[str, str]:
    """This process's environment without what would put the checkout on a child's ``sys.path``."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}


def build_wheel(tmp: Path) -> Path:
    """The wheel of this checkout, built offline (no build isolation, no index)."""
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(path, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp / "dist"), str(src)], check=True, capture_output=True)
    (wheel,) = (tmp / "dist").glob("shardgen-*.whl")
    return wheel


def fresh_venv(tmp: Path, wheel: Path) -> Path:
    """A new virtualenv holding the wheel, seeing this environment's dependencies (torch, diffusers, ...) through
    a .pth file, so nothing downloads. A .pth line adds a folder without running the .pth files inside it, so an
    editable install of the checkout in this environment stays invisible there."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    venv_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip()
    # the wheel first: with this environment (or PYTHONPATH) visible, pip would find shardgen installed and skip it
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, capture_output=True, env=outside_env())
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (Path(venv_site) / "current_env.pth").write_text("\n".join(deps) + "\n")
    return venv


def committed_samples(run_dir: Path) -> list[str]:
    """The image members of the run's committed shards."""
    return sorted(m for tar in run_dir.rglob("*.tar") for m in tarfile.open(tar).getnames() if m.endswith(".png"))


def test_the_installed_wheel_runs_the_quick_start_outside_the_checkout(tmp_path):
    venv = fresh_venv(tmp_path, build_wheel(tmp_path))
    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    env = outside_env()
    env["SHARDGEN_CACHE"] = str(tmp_path / "cache")  # the tiny model built by the installed package itself
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import sys, shardgen, jobs, parallel; print(shardgen.__file__); print(jobs.__file__); "
                            "print(parallel.__file__); print('\\n'.join(sys.path))"],
                           cwd=work, env=env, check=True, capture_output=True, text=True).stdout
    modules, paths = where.splitlines()[:3], where.splitlines()[3:]
    assert all(m.startswith(str(venv)) for m in modules), where  # the packages come from the fresh venv
    # no sys.path entry is the checkout or a folder of it (the test environment's own venv, which the fresh one sees
    # through --system-site-packages, may live inside the checkout: CI makes it there)
    inside = [p for p in paths if p and Path(p).resolve().is_relative_to(ROOT) and ".venv" not in Path(p).parts]
    assert inside == [], where
    commands = {"console": [str(venv / "bin" / "shardgen"), "generate"],
                "module": [str(venv / "bin" / "python"), "-m", "jobs.generate"]}
    for name, command in commands.items():
        done = subprocess.run([*command, "prompts.path=prompts.txt", f"run_dir=runs/{name}"],
                              cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (name, done.stderr[-3000:])
        assert len(committed_samples(work / "runs" / name)) == len(PROMPTS), name
