"""Atomic writes: a file or a folder appears whole under its name, or not at all.

Both write under a temporary name beside the target (``.tmp-NAME-PID-RANDOM``, so concurrent writers never
share one and `checkpoint` can sweep what a crash left), fsync what was written, rename it into place in one
step, and fsync the parent folder so the rename survives a power cut. If the body raises, the temporary is
deleted and the target is untouched.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TMP_PREFIX = ".tmp-"


def temporary_sibling(target: Path) -> Path:
    return target.with_name(f"{TMP_PREFIX}{target.name}-{os.getpid()}-{secrets.token_hex(4)}")


def fsync_path(path: Path) -> None:
    """fsync a file (its data is on disk) or a folder (the entries created or renamed in it are)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary path for the body to write (any writer: open(), safetensors, numpy); when the body
    returns, that file replaces `path`. Creates the parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_sibling(path)
    try:
        yield temporary
        fsync_path(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)  # gone after the replace; what the body left otherwise
    fsync_path(path.parent)


def write_atomically(path: str | os.PathLike, data: bytes) -> None:
    """`path` holds `data`, whole: the old content or the new one survives a crash, never a mix."""
    with atomic_file(path) as temporary:
        temporary.write_bytes(data)


@contextmanager
def atomic_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Yields a new empty folder for the body to fill; when the body returns, every file in it is fsynced and
    the folder is renamed to `target` (replacing an empty folder there; a non-empty one makes the rename raise
    OSError, as when another process got there first). Creates the parent folders."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_sibling(target)
    temporary.mkdir()
    try:
        yield temporary
        for file in sorted(temporary.rglob("*")):
            if file.is_file():
                fsync_path(file)
        fsync_path(temporary)
        os.rename(temporary, target)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)  # gone after the rename; what the body left otherwise
    fsync_path(target.parent)
