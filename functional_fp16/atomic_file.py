"""Atomic file writes: a file is either the old one or the complete new one.

:func:`atomic_torch_save` writes to a temporary file in the target's
directory, flushes and fsyncs it, renames it over the target with
:func:`os.replace` and fsyncs the directory. A crash at any point leaves the
previous file or the new one, never a mixture.

A writer killed before its rename (SIGKILL, power loss) leaves its temporary
file ``.NAME.HOST.PID.*.tmp`` beside the target. It is never read; the next
save of the same target on that host deletes the ones whose process is gone
(:func:`remove_stale_temporaries`). Temporaries of live writers, and of other
hosts on a shared file system, are left alone.
"""

from __future__ import annotations

import os
import socket
import tempfile
from typing import Any, Union

import torch

from functional_fp16 import _deprecation as deprecation

__all__ = ["atomic_torch_save", "remove_stale_temporaries"]

PathLike = Union[str, "os.PathLike[str]"]


def _file_mode(path: str) -> int:
    """The mode for a new checkpoint: the replaced file's, else what ``open`` would give."""
    try:
        return os.stat(path).st_mode & 0o777
    except OSError:
        pass
    umask = 0o022
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    umask = int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o666 & ~umask


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _temp_prefix(path: str) -> str:
    """``.NAME.HOST.`` : the temporary files of ``path``'s writers, named by host and pid."""
    host = socket.gethostname().replace(".", "_") or "host"
    return f".{os.path.basename(path)}.{host}."


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temporaries(path: PathLike) -> list[str]:
    """Deletes temporary files of ``path`` left by writers on this host that no longer run.

    A save killed before its rename (SIGKILL, power loss) leaves its
    ``.NAME.HOST.PID.*.tmp`` file behind. Files of live processes, and of
    other hosts (a shared file system), are left alone. Returns the removed paths.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    prefix = _temp_prefix(path)
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        pid_text = name[len(prefix) :].split(".", 1)[0]
        if not pid_text.isdigit() or _pid_alive(int(pid_text)):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(os.path.join(directory, name))
        except OSError:  # another cleaner got there first
            pass
    return removed


def _is_path(x: Any) -> bool:
    return isinstance(x, (str, bytes, os.PathLike))


def atomic_torch_save(path: PathLike, obj: Any) -> None:
    """``torch.save(obj, path)`` atomically: temp file, fsync, rename, fsync of the directory.

    A crash at any point leaves either the previous file at ``path`` or the new
    one, never a partial file. A writer killed before its rename leaves a
    ``.NAME.HOST.PID.*.tmp`` file beside ``path``; the next save of ``path``
    deletes those of dead processes on this host (see
    :func:`remove_stale_temporaries`).
    """
    if _is_path(obj) and not _is_path(path):
        deprecation.warn(
            "atomic_torch_save(obj, path) is deprecated; call atomic_torch_save(path, obj)"
        )
        path, obj = obj, path
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(
        prefix=f"{_temp_prefix(path)}{os.getpid()}.", suffix=".tmp", dir=directory
    )
    try:
        with os.fdopen(fd, "wb") as f:
            if hasattr(os, "fchmod"):  # mkstemp creates the file private (0600)
                os.fchmod(f.fileno(), _file_mode(path))
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)
