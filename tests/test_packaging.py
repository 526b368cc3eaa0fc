"""The package as users install it: a wheel built from this tree, installed with pip
into a fresh virtual environment that sees only sparcml's declared runtime
dependencies (no dev extras, no source tree), imports, type-checks as typed, and
runs ``sparcml demo``."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.spawn


def _runtime_closure(name: str) -> set[str]:
    """``name``'s runtime dependencies, transitively (extras and unmet markers left out)."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        dist = md.distribution(todo.pop())
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            key = req.name.lower().replace("_", "-")
            if key not in seen:
                seen.add(key)
                todo.append(req.name)
    return seen


def _link_dependencies(deps: set[str], into: Path) -> None:
    """Symlink every top-level file and folder of each distribution into ``into``:
    a site folder holding the runtime dependencies and nothing else."""
    into.mkdir()
    for name in deps:
        dist = md.distribution(name)
        base = Path(str(dist.locate_file("")))
        tops = {Path(str(f)).parts[0] for f in dist.files or []}
        for top in tops:
            src = base / top
            if top.endswith(".pth") or top in ("..", "__pycache__") or not src.exists():
                continue
            dst = into / top
            if not dst.exists():
                dst.symlink_to(src)


def test_the_wheel_installs_into_a_fresh_environment_and_runs_the_demo(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("sparcml-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "sparcml/py.typed" in names  # PEP 561: the package's annotations are shipped
    assert not any(n.startswith(("tests/", "docs/", "benchmarks/")) for n in names)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps",
         "--no-index", "-q", str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    deps = _runtime_closure("sparcml")
    assert {"torch", "numpy", "numba"} <= deps
    _link_dependencies(deps, tmp_path / "deps")
    (site / "runtime-deps.pth").write_text(str(tmp_path / "deps") + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["HOME"] = str(tmp_path)  # no user site, no calibration file
    probe = subprocess.run(
        [str(py), "-c",
         "import sparcml, sparcml.torch, importlib.util as u; print(sparcml.__file__); "
         "print(sparcml.__version__); print(u.find_spec('pytest') is None)"],
        check=True, capture_output=True, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    where, version, no_pytest = probe.stdout.split()
    assert Path(where).is_relative_to(site), where  # the wheel's copy, not the source tree
    assert version == md.version("sparcml")
    assert no_pytest == "True"  # the dev extras are not visible
    demo = subprocess.run(
        [str(venv / "bin" / "sparcml"), "demo"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
