"""Makes molecule/scenario.py (the helpers every scenario's verifier tests share) importable as `scenario`, and
tests/wheel_venv.py (the wheel installed in a fresh venv, which the site scenario shares with tests/test_wheel.py)
as `wheel_venv`."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parent / "tests"))  # last: nothing there may shadow a module found elsewhere
