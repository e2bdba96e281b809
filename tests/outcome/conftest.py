"""Make the repository root importable, so that tests can import ``experiments``."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.append(ROOT)  # last, so that nothing installed is shadowed
