"""Atomic writes: a file (or a checkpoint directory) is either the old one or the complete new one.

:func:`atomic_write` (and :func:`atomic_torch_save`, which uses it) writes
to a temporary file in the target's directory, flushes and fsyncs it,
renames it over the target with :func:`os.replace` and fsyncs the
directory. A crash at any point leaves the
previous file or the new one, never a mixture.

A writer killed before its rename (SIGKILL, power loss) leaves its temporary
file ``.NAME.HOST.PID.RANDOM.tmp`` beside the target. It is never read; the
next save into the same directory on that host deletes the ones whose
process is gone, whatever their target's name
(:func:`remove_stale_temporaries`), so a run that writes a new name each
epoch does not collect them. Temporaries of live writers, and of other hosts
on a shared file system, are left alone.

A checkpoint directory (DCP's) is written the same way:
:func:`new_temporary_directory` makes ``.NAME.HOST.PID.RANDOM.tmp`` beside
it, and :func:`replace_directory` swaps the complete one into place with
one ``renameat2(RENAME_EXCHANGE)`` (Linux) and deletes the old one. A writer
killed at any point leaves the previous directory at ``NAME`` and at most
its temporary (the new files, or the old ones after the swap), which the
next save removes like a temporary file.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable
from typing import Any, BinaryIO, Union

import torch

from functional_fp16._util import deprecation

__all__ = [
    "atomic_write",
    "atomic_torch_save",
    "remove_stale_temporaries",
    "new_temporary_directory",
    "replace_directory",
]

PathLike = Union[str, "os.PathLike[str]"]


def file_mode(path: str) -> int:
    """The mode for a new checkpoint: the replaced file's, else what ``open`` would give."""
    try:
        return os.stat(path).st_mode & 0o777
    except OSError:
        pass
    return 0o666 & ~_umask()


def _umask() -> int:
    """This process's umask, read without changing it (``/proc``; 022 where unreadable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def fsync_dir(directory: str) -> None:
    """Fsyncs ``directory``, so that a rename or a new entry in it survives a crash (best effort)."""
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


def _host() -> str:
    """This host's name as it appears in temporary file names (no dots)."""
    return socket.gethostname().replace(".", "_") or "host"


def _temp_prefix(path: str) -> str:
    """``.NAME.HOST.`` : the temporary files of ``path``'s writers, named by host and pid."""
    return f".{os.path.basename(path)}.{_host()}."


_RANDOM_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_")  # tempfile's name characters
_MAX_PID = 2**22  # Linux's pid_max limit


def _temp_writer(name: str, host: str) -> int | None:
    """The pid in ``name`` if it is a temporary file ``.NAME.HOST.PID.RANDOM.tmp`` of ``host``.

    HOST, PID and RANDOM hold no dots, so the name is read from its end; NAME
    (the target's name) may hold anything.
    """
    if not (name.startswith(".") and name.endswith(".tmp")):
        return None
    parts = name[1 : -len(".tmp")].rsplit(".", 3)
    if len(parts) != 4:
        return None
    target, name_host, pid, random = parts
    if (
        not target
        or name_host != host
        or not (pid.isascii() and pid.isdigit())
        or not 0 < int(pid) < _MAX_PID
        or not random
        or not set(random) <= _RANDOM_CHARS
    ):
        return None
    return int(pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temporaries(path: PathLike) -> list[str]:
    """Deletes the temporary files in ``path``'s directory left by writers on this host that no longer run.

    A save killed before its rename (SIGKILL, power loss) leaves its
    ``.NAME.HOST.PID.RANDOM.tmp`` file behind. Those of every target name in
    the directory are removed, not only ``path``'s, so that a run writing a
    new name each epoch (``checkpoint_epoch_001.pt``, ...) does not collect
    them. Files of live processes, and of other hosts (a shared file system),
    are left alone.

    Args:
      path: a file in the directory to clean (typically the checkpoint about
        to be written).

    Returns:
      The removed paths.
    """
    directory = os.path.dirname(os.path.abspath(os.fspath(path)))
    host = _host()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        pid = _temp_writer(name, host)
        if pid is None or _pid_alive(pid):
            continue
        full = os.path.join(directory, name)
        try:
            if stat.S_ISDIR(os.lstat(full).st_mode):  # a checkpoint directory's
                shutil.rmtree(full)
            else:
                os.unlink(full)
            removed.append(full)
        except OSError:  # another cleaner got there first
            pass
    return removed


def _is_path(x: Any) -> bool:
    return isinstance(x, (str, bytes, os.PathLike))


def atomic_write(path: PathLike, write: Callable[[BinaryIO], Any]) -> None:
    """Writes ``path`` atomically: temp file, fsync, rename, fsync of the directory.

    ``write(f)`` fills ``f``, a temporary file opened for binary writing in
    ``path``'s directory and named ``.NAME.HOST.PID.RANDOM.tmp``, with the
    mode of the file it replaces (else what ``open`` would give). The file is
    then flushed, fsynced and renamed over ``path`` with :func:`os.replace`,
    and the directory is fsynced. A crash at any point leaves either the
    previous file at ``path`` or the new one, never a partial file; if
    ``write`` raises, the temporary file is removed and the error propagates.
    Before writing, the temporary files that dead writers on this host left in
    the directory are deleted (:func:`remove_stale_temporaries`).
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(
        prefix=f"{_temp_prefix(path)}{os.getpid()}.", suffix=".tmp", dir=directory
    )
    try:
        with os.fdopen(fd, "wb") as f:
            if hasattr(os, "fchmod"):  # mkstemp creates the file private (0600)
                os.fchmod(f.fileno(), file_mode(path))
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(directory)


def atomic_torch_save(path: PathLike, obj: Any) -> None:
    """``torch.save(obj, path)`` atomically: temp file, fsync, rename, fsync of the directory.

    A crash at any point leaves either the previous file at ``path`` or the new
    one, never a partial file. A writer killed before its rename leaves a
    ``.NAME.HOST.PID.RANDOM.tmp`` file beside ``path``; the next save into
    the same directory deletes those of dead processes on this host, for
    every target name (see :func:`remove_stale_temporaries`). See
    :func:`atomic_write`.
    """
    if _is_path(obj) and not _is_path(path):
        deprecation.warn(
            "atomic_torch_save(obj, path) is deprecated; call atomic_torch_save(path, obj)"
        )
        path, obj = obj, path
    atomic_write(path, lambda f: torch.save(obj, f))


def new_temporary_directory(path: PathLike) -> str:
    """A new empty directory ``.NAME.HOST.PID.RANDOM.tmp`` beside ``path``, to be filled
    and then moved into place with :func:`replace_directory`.

    The temporaries that dead writers on this host left beside it, files and
    directories, are deleted first (:func:`remove_stale_temporaries`). The new
    directory gets the mode of the one it will replace (else what ``mkdir``
    would give).

    Raises:
      NotADirectoryError: ``path`` exists and is not a directory.
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.lexists(path) and not (os.path.isdir(path) and not os.path.islink(path)):
        raise NotADirectoryError(f"{path} exists and is not a directory")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    remove_stale_temporaries(path)
    tmp = tempfile.mkdtemp(
        prefix=f"{_temp_prefix(path)}{os.getpid()}.", suffix=".tmp", dir=os.path.dirname(path)
    )
    try:
        mode = os.stat(path).st_mode & 0o777
    except OSError:
        mode = 0o777 & ~_umask()  # what mkdir would give
    os.chmod(tmp, mode)
    return tmp


def replace_directory(tmp: PathLike, path: PathLike) -> None:
    """Moves the complete directory ``tmp`` (from :func:`new_temporary_directory`) to ``path``.

    If ``path`` does not exist, one ``rename``. If it does, the two are
    swapped with ``renameat2(RENAME_EXCHANGE)`` and the old one, now at
    ``tmp``, is deleted; either way ``path`` is at every instant the old
    directory or the new one. Where the exchange is not available (not Linux,
    or a file system without it) the old directory is first renamed to a
    temporary of its own: a crash between the two renames leaves no
    directory at ``path`` (the previous one is in that temporary). The
    parent directory is fsynced.
    """
    tmp, path = os.fspath(tmp), os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    fsync_dir(tmp)
    if not os.path.lexists(path):
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        fsync_dir(parent)
        shutil.rmtree(tmp)
    else:
        old = tempfile.mkdtemp(
            prefix=f"{_temp_prefix(path)}{os.getpid()}.", suffix=".tmp", dir=parent
        )
        os.rename(path, old)  # replaces the empty directory just made
        os.rename(tmp, path)
        fsync_dir(parent)
        shutil.rmtree(old)
    fsync_dir(parent)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swaps the entries ``a`` and ``b`` atomically (``renameat2(RENAME_EXCHANGE)``); ``False``
    where this system or file system cannot."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)
