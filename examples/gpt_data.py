"""Data for ``gpt_functional.py``: a text as character tokens, split into training and validation.

Every source ends up as the same :class:`TextData`: the characters of the
text as ``int64`` token ids (the vocabulary is the sorted set of characters
that occur), the first ``1 - val_fraction`` of them for training and the
rest for validation, so that batches are slices of one in-memory tensor.

Sources, in the order they are tried:

* ``--text PATH`` — any UTF-8 text file;
* ``<data_dir>/tinyshakespeare.txt`` — Tiny Shakespeare (1,115,394 bytes),
  fetched there by ``--download`` once and read from there afterwards; the
  size and SHA-256 of a download are checked before it is kept;
* otherwise (or with ``--synthetic``) a synthetic play-like text generated
  from a fixed seed, learnable but not English, announced in one line so
  that its losses are never mistaken for Tiny Shakespeare's.

Batches (:func:`sample_batch`) are windows of ``context + 1`` tokens at
offsets drawn from a ``torch.Generator``, so a run that keeps the generator's
state (its checkpoints do) draws the same batches after a resume, and the
stock recipe (``benchmarks/stock_gpt.py``) draws the same ones as the
example. Validation (:func:`val_windows`) reads the validation split in
consecutive non-overlapping windows, the same every time.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple

import torch

SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
SHAKESPEARE_FILE = "tinyshakespeare.txt"
SHAKESPEARE_BYTES = 1_115_394
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SYNTHETIC_SEED = 0


class TextData(NamedTuple):
    """A text as token ids, split, with where it came from."""

    train: torch.Tensor  # (N_train,) int64 token ids
    val: torch.Tensor  # (N_val,) int64 token ids: the last val_fraction of the text
    chars: str  # the vocabulary: token id i is chars[i]
    source: str  # "tinyshakespeare", "synthetic", or the file's name
    synthetic: bool  # True for generated text: its losses say nothing about Tiny Shakespeare
    digest: str  # SHA-256 of the text's UTF-8 bytes (a resumed run checks it)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def decode(self, ids: list[int]) -> str:
        """The text of a list of token ids; an id past the text's vocabulary (a model
        whose vocabulary is larger, such as ``--preset gpt2``'s) as U+FFFD."""
        n = len(self.chars)
        return "".join(self.chars[i] if i < n else "\ufffd" for i in ids)

    def describe(self) -> str:
        """``"Tiny Shakespeare"``, ``"synthetic text"`` or the file's name, for messages."""
        if self.synthetic:
            return "synthetic text"
        return "Tiny Shakespeare" if self.source == "tinyshakespeare" else self.source


class DataError(RuntimeError):
    """The requested text cannot be loaded; the message is one line for the user."""


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- sources -------------------------------------------------------------------------


def read_text(path: Path) -> str:
    """The contents of a UTF-8 text file, or a one-line :class:`DataError`."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"--text {path}: no such file") from None
    except UnicodeDecodeError as err:
        raise DataError(
            f"--text {path}: not UTF-8 text ({err.reason} at byte {err.start})"
        ) from None
    except OSError as err:
        raise DataError(f"--text {path}: {err.strerror or err}") from None


def download_shakespeare(target: Path) -> None:
    """Fetches Tiny Shakespeare into ``target``, checking its size and SHA-256 first."""
    log(f"downloading Tiny Shakespeare from {SHAKESPEARE_URL}")
    try:
        with urllib.request.urlopen(SHAKESPEARE_URL, timeout=60) as response:
            blob = response.read()
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise DataError(f"--download failed ({reason}); give a text with --text PATH") from None
    if len(blob) != SHAKESPEARE_BYTES or hashlib.sha256(blob).hexdigest() != SHAKESPEARE_SHA256:
        raise DataError(
            f"--download: got {len(blob)} bytes that are not Tiny Shakespeare "
            f"({SHAKESPEARE_BYTES} bytes, sha256 {SHAKESPEARE_SHA256[:12]}...); nothing was kept"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    partial.write_bytes(blob)
    os.replace(partial, target)


def synthetic_text(n_chars: int, seed: int = SYNTHETIC_SEED) -> str:
    """A learnable play-like text of ``n_chars`` characters, the same for a given ``seed``.

    A lexicon of 400 pseudo-words (random lowercase letters, 1-8 long) is
    drawn once; speeches are runs of sentences of 3-11 words picked with
    Zipf-like frequencies (word ``r`` with weight ``1 / (r + 1)``), each
    sentence capitalised and ended with ``.``, ``,``, ``?`` or ``!``, under a
    speaker line (one of 12 upper-case names and a colon) and followed by a
    blank line. Spelling, word frequencies and layout are learnable; the
    word order is not, so the loss has a floor well above zero.
    """
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 8))) for _ in range(400)]
    weights = [1.0 / (r + 1) for r in range(len(words))]
    names = [w.upper() for w in rng.sample(words[:60], 12)]
    parts: list[str] = []
    size = 0
    while size < n_chars:
        sentences = []
        for _ in range(rng.randint(1, 4)):
            chosen = rng.choices(words, weights, k=rng.randint(3, 11))
            sentence = " ".join(chosen)
            sentences.append(sentence[0].upper() + sentence[1:] + rng.choice(".,?!"))
        speech = f"{rng.choice(names)}:\n{' '.join(sentences)}\n\n"
        parts.append(speech)
        size += len(speech)
    return "".join(parts)[:n_chars]


# -- tokens and splits ---------------------------------------------------------------


def encode(text: str) -> tuple[torch.Tensor, str]:
    """The text's token ids (``int64``) and its vocabulary (the sorted distinct characters)."""
    chars = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.int64), chars


def split_text(
    text: str, *, source: str, synthetic: bool, val_fraction: float, context: int
) -> TextData:
    """Tokenises ``text`` and splits it: the last ``val_fraction`` is the validation split."""
    if not text:
        raise DataError(f"{source}: the text is empty")
    tokens, chars = encode(text)
    n_val = int(round(len(tokens) * val_fraction))
    n_train = len(tokens) - n_val
    for name, n in (("training", n_train), ("validation", n_val)):
        if n < context + 1:
            raise DataError(
                f"{source}: the {name} split has {n} characters, fewer than --context + 1 "
                f"({context + 1}); give a longer text or a shorter --context"
            )
    return TextData(
        train=tokens[:n_train],
        val=tokens[n_train:],
        chars=chars,
        source=source,
        synthetic=synthetic,
        digest=hashlib.sha256(text.encode("utf-8")).hexdigest(),
    )


def load_text(
    *,
    text: str | os.PathLike | None,
    data_dir: str | os.PathLike,
    download: bool = False,
    synthetic: bool = False,
    synthetic_chars: int = SHAKESPEARE_BYTES,
    val_fraction: float = 0.1,
    context: int = 128,
) -> TextData:
    """The text the flags ask for (see the module docstring for the order), tokenised and split.

    Raises :class:`DataError` (one line) for a missing or unreadable ``--text``
    or a failed ``--download``. Without any text and without ``--download``
    it says so in one line on stderr and returns the synthetic text.
    """

    def split(body: str, source: str, is_synthetic: bool = False) -> TextData:
        return split_text(
            body,
            source=source,
            synthetic=is_synthetic,
            val_fraction=val_fraction,
            context=context,
        )

    if synthetic:
        return split(synthetic_text(synthetic_chars), "synthetic", True)
    if text is not None:
        path = Path(text)
        return split(read_text(path), path.name)
    cached = Path(data_dir) / SHAKESPEARE_FILE
    if not cached.is_file() and download:
        download_shakespeare(cached)
    if cached.is_file():
        return split(read_text(cached), "tinyshakespeare")
    log(
        f"note: no text given and no {cached} (use --text PATH or --download); "
        "training on SYNTHETIC text, so the losses are not Tiny Shakespeare losses"
    )
    return split(synthetic_text(synthetic_chars), "synthetic", True)


# -- batches -------------------------------------------------------------------------


def sample_batch(
    tokens: torch.Tensor, generator: torch.Generator, batch: int, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``batch`` random windows of ``tokens``: inputs and next-token targets, ``(batch, context)``.

    With offsets :math:`o_b \sim U\{0, \ldots, N - T - 1\}` drawn from
    ``generator`` (on the CPU, so the draw is the same on every device):

    .. math:: x_{b,t} = \text{tokens}[o_b + t], \qquad y_{b,t} = \text{tokens}[o_b + t + 1]

    The windows are gathered on ``tokens``' device.
    """
    starts = torch.randint(0, tokens.numel() - context, (batch,), generator=generator)
    index = starts.to(tokens.device)[:, None] + torch.arange(context + 1, device=tokens.device)
    windows = tokens[index]
    return windows[:, :-1], windows[:, 1:]


def val_windows(tokens: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The validation split as consecutive non-overlapping windows: ``(W, context)`` inputs, targets.

    Window :math:`w` covers tokens :math:`[wT, (w+1)T)` as inputs and the
    tokens one further as targets, :math:`W = \lfloor (N - 1) / T \rfloor`;
    the loss over them is the mean over :math:`WT` predicted characters.
    """
    n = (tokens.numel() - 1) // context
    x = tokens[: n * context].view(n, context)
    y = tokens[1 : n * context + 1].view(n, context)
    return x, y
