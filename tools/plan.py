"""`python tools/plan.py ...` is `python -m maxshard.plan ...` (kept for old commands and sweep files)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxshard.plan import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
