"""`dataset_path` -> the sorted files it names: a file, a directory (searched recursively) or a glob; local or remote.

Remote paths (`gs://...`, anything with `://`) go through `etils.epath`, which orbax already brings in, so listing and
opening them needs no TensorFlow. Local paths use `os`/`glob` directly (faster, and the only kind the tests cover).
Dot-files and dot-directories are skipped in directory listings, as for text corpora.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from typing import IO

from maxshard.errors import ConfigError

__all__ = ["is_remote", "list_files", "open_binary", "relative_name", "has_magic"]


def is_remote(path: str) -> bool:
    return "://" in path


def has_magic(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def list_files(dataset_path: str, suffixes: Sequence[str], key: str = "dataset_path") -> list[str]:
    """Files of a file path, a directory (those ending in one of `suffixes`) or a glob (every file it matches).

    Raises ConfigError naming `key` when the path does not exist or names no file.
    """
    if is_remote(dataset_path):
        paths = _list_remote(dataset_path, suffixes, key)
    elif has_magic(dataset_path):
        paths = sorted(p for p in glob.glob(dataset_path, recursive=True) if os.path.isfile(p))
    elif os.path.isdir(dataset_path):
        paths = _walk(dataset_path, tuple(suffixes))
    elif os.path.isfile(dataset_path):
        paths = [dataset_path]
    else:
        raise ConfigError(f"{key}={dataset_path}: no such file or directory")
    if not paths:
        what = f" ending in {', '.join(suffixes)}" if not has_magic(dataset_path) else ""
        raise ConfigError(f"{key}={dataset_path} matches no files{what} (empty corpus)")
    return paths


def relative_name(path: str, dataset_path: str) -> str:
    """A file's name relative to the root of `dataset_path` (its directory, or a glob's fixed prefix).

    Split keys hash this name, so a corpus moved to another directory or bucket keeps its train/eval split.
    """
    if has_magic(dataset_path):
        parts = dataset_path.split("/")
        fixed = []
        for part in parts[:-1]:
            if has_magic(part):
                break
            fixed.append(part)
        root = "/".join(fixed)
    elif path == dataset_path:
        root = dataset_path.rsplit("/", 1)[0] if "/" in dataset_path else ""
    else:
        root = dataset_path
    if root and path.startswith(root.rstrip("/") + "/"):
        return path[len(root.rstrip("/")) + 1:]
    return path


def open_binary(path: str) -> IO[bytes]:
    """A binary file object for reading, local or remote."""
    if is_remote(path):
        from etils import epath  # deferred: only remote paths need it

        return epath.Path(path).open("rb")
    return open(path, "rb")


def _walk(root: str, suffixes: tuple[str, ...]) -> list[str]:
    found = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.join(directory, f) for f in sorted(files) if f.endswith(suffixes) and not f.startswith(".")]
    return found


def _list_remote(dataset_path: str, suffixes: Sequence[str], key: str) -> list[str]:
    from etils import epath

    if has_magic(dataset_path):
        scheme, rest = dataset_path.split("://", 1)
        bucket, _, pattern = rest.partition("/")
        root = epath.Path(f"{scheme}://{bucket}")
        return sorted(str(p) for p in root.glob(pattern) if p.is_file())
    path = epath.Path(dataset_path)
    if path.is_dir():
        return sorted(str(p) for p in path.rglob("*") if p.is_file() and str(p).endswith(tuple(suffixes)))
    if path.exists():
        return [dataset_path]
    raise ConfigError(f"{key}={dataset_path}: no such file or directory")
