"""SIGKILL at a chosen point of ``save_dcp_state``, for the crash tests of DCP saves.

:func:`arm` makes this process kill itself (``SIGKILL``: no clean-up, no
``finally``) the next time the save reaches ``point``:

* ``data``: DCP fsyncs a data file it wrote (the data half written, no ``.metadata``);
* ``metadata``: every rank has finished and ``.metadata`` is complete, before
  the new directory is moved into place;
* ``swapped``: the new directory is in place, the old one not yet deleted.
"""

from __future__ import annotations

import os
import signal

from functional_fp16.checkpoint import atomic_file
from functional_fp16.distributed import dcp_state

POINTS = ("data", "metadata", "swapped")


def _die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def arm(point: str) -> None:
    if point == "data":
        os.fsync = _die  # DCP's writer fsyncs each file it wrote; nothing before it does
    elif point == "metadata":
        dcp_state.replace_directory = _die
    elif point == "swapped":
        atomic_file.shutil.rmtree = _die  # replace_directory deletes the old one after the swap
    else:
        raise ValueError(f"no kill point {point!r}; one of {POINTS}")
