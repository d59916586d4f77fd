"""`python -m maxshard.train` whose checkpoint commit of one step is refused, as by an unwritable directory.

Usage: FAIL_STEP=N python tests/failing_commit.py configs/base.yml key=value ...

Orbax commits a step in its background thread by renaming `<step>.orbax-checkpoint-tmp*` to `<step>`; for step
FAIL_STEP that rename raises PermissionError (EACCES), after printing "injected: ..." so the test knows when the
failure happened relative to the progress lines.
"""

from __future__ import annotations

import errno
import os
import sys

_rename = os.rename


def _refusing_rename(src: str, dst: str, *args: object, **kwargs: object) -> None:
    if "orbax-checkpoint-tmp" in os.fspath(src) and os.path.basename(os.fspath(dst)) == os.environ["FAIL_STEP"]:
        print(f"injected: the commit of step {os.environ['FAIL_STEP']} is refused", flush=True)
        raise PermissionError(errno.EACCES, "Permission denied", os.fspath(dst))
    _rename(src, dst, *args, **kwargs)


if __name__ == "__main__":
    os.rename = _refusing_rename
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from maxshard.train import main

    sys.exit(main(sys.argv[1:]))
