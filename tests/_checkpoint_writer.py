"""Helper for tests/test_crash_safety.py: forks children that write checkpoints until killed.

Run as ``python tests/_checkpoint_writer.py PATH``. It imports torch once and
then serves commands from stdin, one per line:

* ``fork GEN`` — fork a child that saves generations GEN+1, GEN+2, ... to
  PATH forever, printing ``saved N`` after each save returns; the server
  prints ``pid P``.
* ``epochs N`` — fork a child that saves generation N to
  ``checkpoint_epoch_NNN.pt`` beside PATH, then N+1 to the next name, and so
  on, one new file per epoch as a training run does, printing ``saved N``
  after each; the server prints ``pid P``.
* ``reap P`` — wait for child P (killed by the test) and print ``reaped P SIGNAL``.

Forking from a process that has only imported torch is cheap, so the test can
kill dozens of writers mid-write without paying for an interpreter start each.
"""

from __future__ import annotations

import os
import sys

import torch

import functional_fp16 as ff

BLOB_ELEMENTS = 6 * 2**20  # 24 MiB of float32: a write takes long enough to be hit


def payload(gen: int):
    """The tree saved as generation ``gen``: every value is a function of ``gen``."""
    g = torch.Generator().manual_seed(gen)
    params = {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}
    scale = ff.DynamicLossScale(init_scale=2.0 ** (gen % 20), growth_interval=7)
    state = ff.fp16_init(params, ff.sgd(0.1, momentum=0.9), scale)
    blob = torch.arange(BLOB_ELEMENTS, dtype=torch.float32) + float(gen)
    return {"gen": gen, "state": state, "blob": blob, "tag": f"generation {gen}"}


EPOCH_NAME = "checkpoint_epoch_{:03d}.pt"


def _child(path: str, gen: int) -> None:
    while True:
        gen += 1
        ff.save_checkpoint(path, payload(gen))
        os.write(1, f"saved {gen}\n".encode())


def _epochs(path: str, epoch: int) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    while True:
        ff.save_checkpoint(os.path.join(directory, EPOCH_NAME.format(epoch)), payload(epoch))
        os.write(1, f"saved {epoch}\n".encode())
        epoch += 1


def main() -> None:
    path = sys.argv[1]
    torch.set_num_threads(1)
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, arg = line.split()
        if cmd in ("fork", "epochs"):
            pid = os.fork()
            if pid == 0:
                try:
                    (_child if cmd == "fork" else _epochs)(path, int(arg))
                finally:
                    os._exit(1)
            print(f"pid {pid}", flush=True)
        elif cmd == "reap":
            _, status = os.waitpid(int(arg), 0)
            print(
                f"reaped {arg} {os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1}", flush=True
            )


if __name__ == "__main__":
    main()
