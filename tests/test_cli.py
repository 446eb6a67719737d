"""The real entry points, as a user starts them: `python -m hy3spark` and the `hy3spark` console script."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hy3spark", *argv], cwd=REPO, capture_output=True, text=True)


def test_help_explains_commands_and_exit_codes() -> None:
    proc = run("--help")
    assert proc.returncode == 0
    for word in ("render", "validate", "profiles", "exit codes:", "3 invalid cluster spec"):
        assert word in proc.stdout
    render_help = run("render", "--help").stdout
    for flag in ("--out DIR", "--only NAME", "--diff DIR", "--format {text,json}"):
        assert flag in render_help


def test_module_render_no_arguments() -> None:
    proc = run("render")
    assert proc.returncode == 0
    assert proc.stdout.count("==> ") == 26
    assert "is not a commit sha" in proc.stderr  # the default's moving revision is said, on stderr only


def test_bad_spec_exits_3_without_traceback(tmp_path: Path) -> None:
    spec = tmp_path / "c.yml"
    spec.write_text("name: [unclosed\n")
    proc = run("validate", str(spec))
    assert proc.returncode == 3
    assert proc.stderr.startswith(f"error: {spec}:")
    assert "Traceback" not in proc.stderr


def test_unknown_command_is_a_usage_error() -> None:
    proc = run("deploy-everything")
    assert proc.returncode == 2
    assert "invalid choice: 'deploy-everything'" in proc.stderr


def test_console_script_is_installed() -> None:
    exe = shutil.which("hy3spark", path=str(Path(sys.executable).parent))
    assert exe, "the hy3spark console script is missing from the venv: pip install -e ."
    proc = subprocess.run([exe, "profiles"], capture_output=True, text=True)
    assert proc.returncode == 0
    assert "hy3-295b-nvfp4-tp2" in proc.stdout and "gpt-oss-120b-single" in proc.stdout
