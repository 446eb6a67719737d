"""Makes molecule/scenario.py (the helpers every scenario's verifier tests share) importable as `scenario`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
