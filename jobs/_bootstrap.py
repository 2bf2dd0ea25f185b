"""Make ``zerolab`` importable when running from a checkout where it is not pip-installed
(for instance the working directory of ``ray job submit``). Imported by every job."""

import sys
from pathlib import Path

try:
    import zerolab  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))
