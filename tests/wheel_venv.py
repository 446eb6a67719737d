"""The wheel as a user gets it: built from this checkout, installed with its dependencies into a fresh venv in a
temporary directory, and run with an environment that cannot reach back into the checkout.

Shared by tests/test_wheel.py (render, validate, plan from an empty directory) and the site scenario's verifier
(molecule/site/tests/test_site.py: `hy3spark up` and `down` against the Molecule-built cluster; molecule/conftest.py
puts this directory on its sys.path). The dependencies come from PyPI once and are kept as wheels in
.cache/wheel-test/, so a later run installs offline: building and installing then take about 15 s.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WHEELHOUSE = REPO / ".cache" / "wheel-test"
# The variables that would let a child find the checkout or the test's venv instead of its own.
LEAKY = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "ANSIBLE_CONFIG", "ANSIBLE_ROLES_PATH", "ANSIBLE_COLLECTIONS_PATH",
         "ANSIBLE_LIBRARY", "ANSIBLE_FILTER_PLUGINS", "ANSIBLE_LOOKUP_PLUGINS")


@dataclass
class Installed:
    venv: Path
    home: Path  # HOME and the XDG directories of the user running the installed CLI
    env: dict[str, str]

    def run(self, *argv: str, cwd: Path, timeout: float = 120,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """The installed `hy3spark` executable; `env` adds to the user's environment (an exported secret, say)."""
        return subprocess.run([str(self.venv / "bin" / "hy3spark"), *argv], cwd=cwd, env={**self.env, **(env or {})},
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)

    def python(self, code: str, cwd: Path) -> str:
        proc = subprocess.run([str(self.venv / "bin" / "python"), "-c", code], cwd=cwd, env=self.env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    @property
    def site_packages(self) -> Path:
        return self.venv / "lib" / "python3.11" / "site-packages"


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in LEAKY}


def _pip(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), "-m", "pip", *args], env=clean_env(), capture_output=True, text=True,
                          timeout=900)


@contextlib.contextmanager
def installed_wheel(prefix: str = "hy3spark-wheel-") -> Iterator[Installed]:
    """The wheel installed in a fresh venv under a new temporary directory, removed afterwards (each venv is about
    600 MB: not left to pytest's tmp_path retention)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield install(Path(tmp))


def install(base: Path) -> Installed:
    dist = base / "dist"
    built = _pip(Path(sys.executable), "wheel", "--no-deps", "--quiet", "-w", str(dist), str(REPO))
    assert built.returncode == 0, built.stderr
    (wheel,) = dist.glob("hy3spark-*.whl")
    python311 = shutil.which("python3.11")
    assert python311, "python3.11 is not on PATH: the wheel is tested on the Python CI runs"
    venv = base / "venv"
    subprocess.run([python311, "-m", "venv", str(venv)], check=True, env=clean_env(), timeout=300)
    py = venv / "bin" / "python"
    # Offline from the wheelhouse when it holds every dependency; otherwise fetch them into it, then install.
    offline = ("install", "--quiet", "--no-compile", "--no-index", "--find-links", str(WHEELHOUSE), str(wheel))
    if _pip(py, *offline).returncode != 0:
        got = _pip(py, "download", "--quiet", "-d", str(WHEELHOUSE), str(wheel))
        assert got.returncode == 0, got.stderr
        for own in WHEELHOUSE.glob("hy3spark-*.whl"):  # the wheel under test comes from dist/, never from here
            own.unlink()
        done = _pip(py, *offline)
        assert done.returncode == 0, done.stderr
    home = base / "home"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "LC_ALL": "C.UTF-8",
           "XDG_STATE_HOME": str(home / "state"), "XDG_CACHE_HOME": str(home / "cache")}
    return Installed(venv, home, env)
