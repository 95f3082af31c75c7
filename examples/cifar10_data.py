"""Data for ``cifar10_functional.py``: whole datasets decoded once into uint8 tensors.

Every source ends up as the same thing, a :class:`Data` holding the training
and test images as ``uint8`` tensors of shape ``(N, 3, H, W)`` plus ``int64``
labels, so that training batches are plain slices of in-memory tensors and no
image is decoded twice.

Sources (all through torchvision):

* ``cifar10`` — ``torchvision.datasets.CIFAR10`` under ``data_dir`` (the
  ``cifar-10-batches-py`` folder). It is downloaded only when ``download`` is
  true; a missing copy or a failed download ends the program with a one-line
  error.
* ``imagefolder`` — any ``train/<class>/*.jpg`` + ``test/<class>/*.jpg`` tree,
  read with ``torchvision.datasets.ImageFolder`` and decoded in parallel
  DataLoader workers. The decoded tensors are
  cached in ``<data_dir>/.decoded/`` (keyed by the file list, sizes and
  modification times), so later runs load them in about a second.
* ``fake`` — a synthetic, learnable CIFAR-shaped set generated from a fixed
  seed (each class is a smooth colour pattern plus noise).
* ``auto`` — ``cifar10`` or ``imagefolder`` when ``data_dir`` holds either
  layout, otherwise ``fake`` with one line saying so.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from functional_fp16.checkpoint import atomic_torch_save

CACHE_VERSION = 1
DATASETS = ("auto", "cifar10", "imagefolder", "fake")
CIFAR10_CLASSES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)


class Split(NamedTuple):
    """One split of a dataset, in memory."""

    images: torch.Tensor  # (N, 3, H, W) uint8
    labels: torch.Tensor  # (N,) int64, in [0, num_classes)


class Data(NamedTuple):
    """A decoded dataset and where it came from."""

    train: Split
    test: Split
    classes: tuple[str, ...]
    source: str  # "cifar10", "imagefolder" or "fake"
    synthetic: bool  # True for generated data: its accuracy says nothing about CIFAR-10
    decode_seconds: float  # time spent decoding image files (0 when cached or not files)


class DataError(RuntimeError):
    """The requested data cannot be loaded; the message is one line for the user."""


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- torchvision CIFAR10 ---------------------------------------------------------


def has_cifar10(data_dir: Path) -> bool:
    """Whether ``data_dir`` holds torchvision's ``cifar-10-batches-py`` folder."""
    return (data_dir / "cifar-10-batches-py").is_dir()


def has_imagefolder(data_dir: Path) -> bool:
    """Whether ``data_dir`` holds ``train/`` and ``test/`` class folders."""
    return (data_dir / "train").is_dir() and (data_dir / "test").is_dir()


def load_cifar10(data_dir: Path, *, download: bool) -> Data:
    """CIFAR-10 through ``torchvision.datasets.CIFAR10``; downloads only if ``download``."""
    from torchvision.datasets import CIFAR10

    splits = []
    for train in (True, False):
        try:
            ds = CIFAR10(root=str(data_dir), train=train, download=download)
        except RuntimeError as err:
            hint = "" if download else "; pass --download to fetch it (needs network access)"
            raise DataError(
                f"CIFAR-10 not found or corrupted under {data_dir} ({err}){hint}"
            ) from None
        except OSError as err:  # URLError, socket errors, disk errors
            raise DataError(f"could not download CIFAR-10 into {data_dir}: {err}") from None
        images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()
        labels = torch.tensor(ds.targets, dtype=torch.int64)
        splits.append(Split(images, labels))
    return Data(splits[0], splits[1], CIFAR10_CLASSES, "cifar10", False, 0.0)


# -- ImageFolder trees -----------------------------------------------------------


def _decode_torchvision(path: str) -> torch.Tensor | None:
    """``torchvision.io`` decoding (libjpeg-turbo/libpng), or ``None`` where it is gone."""
    try:
        from torchvision.io import ImageReadMode, decode_image, read_file
    except ImportError:  # removed in later torchvision releases
        return None
    with warnings.catch_warnings():
        # torchvision 0.29 deprecates its decoders in favour of TorchCodec.
        warnings.simplefilter("ignore", DeprecationWarning)
        return decode_image(read_file(path), mode=ImageReadMode.RGB)


def decode_file(path: str, image_size: int) -> torch.Tensor:
    """Reads one image file as a ``(3, image_size, image_size)`` uint8 tensor (RGB).

    Uses ``torchvision.io`` where available (about 4x faster than Pillow for
    small JPEGs) and Pillow otherwise; images of another size are resized
    bilinearly (with antialiasing).
    """
    image = _decode_torchvision(path)
    if image is None:
        from PIL import Image
        from torchvision.transforms.v2.functional import pil_to_tensor

        with Image.open(path) as img:
            image = pil_to_tensor(img.convert("RGB"))
    if image.shape[-2:] != (image_size, image_size):
        from torchvision.transforms.v2.functional import resize

        image = resize(image, [image_size, image_size], antialias=True)
    return image


def _fingerprint(samples: list[tuple[str, int]], root: Path, image_size: int) -> str:
    h = hashlib.sha256(f"v{CACHE_VERSION} size={image_size}\n".encode())
    for path, label in samples:
        st = os.stat(path)
        rel = os.path.relpath(path, root)
        h.update(f"{rel}\t{label}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _save_atomic(obj: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_torch_save(path, obj)


def _decode_split(
    root: Path, image_size: int, workers: int, cache_dir: Path | None, name: str
) -> tuple[Split, tuple[str, ...], float]:
    from torchvision.datasets import ImageFolder

    if not root.is_dir():
        raise DataError(f"{root} does not exist; --dataset imagefolder needs train/ and test/")
    try:
        ds = ImageFolder(str(root), loader=functools.partial(decode_file, image_size=image_size))
    except (FileNotFoundError, RuntimeError) as err:
        raise DataError(f"cannot read the image folder {root}: {err}") from None
    classes = tuple(ds.classes)
    fingerprint = _fingerprint(ds.samples, root, image_size)
    cache = cache_dir / f"{name}_{image_size}x{image_size}.pt" if cache_dir else None
    if cache is not None and cache.is_file():
        try:
            blob = torch.load(cache, map_location="cpu", weights_only=True)
            if blob.get("fingerprint") == fingerprint and tuple(blob["classes"]) == classes:
                return Split(blob["images"], blob["labels"]), classes, 0.0
            log(f"note: {cache} is out of date; decoding {root} again")
        except Exception as err:  # a damaged cache is rebuilt, never trusted
            log(f"note: ignoring unreadable cache {cache} ({type(err).__name__}: {err})")

    from torch.utils.data import DataLoader

    start = time.perf_counter()
    n = len(ds)
    images = torch.empty((n, 3, image_size, image_size), dtype=torch.uint8)
    labels = torch.empty((n,), dtype=torch.int64)
    loader = DataLoader(ds, batch_size=256, shuffle=False, num_workers=workers)
    i = 0
    for batch_images, batch_labels in loader:
        k = batch_images.shape[0]
        images[i : i + k] = batch_images
        labels[i : i + k] = batch_labels
        i += k
    seconds = time.perf_counter() - start
    log(f"decoded {n} images from {root} in {seconds:.1f} s ({workers} workers)")
    if cache is not None:
        blob = {
            "version": CACHE_VERSION,
            "fingerprint": fingerprint,
            "classes": list(classes),
            "images": images,
            "labels": labels,
        }
        try:
            _save_atomic(blob, cache)
        except OSError as err:
            log(f"note: could not write the decoded cache {cache} ({err}); continuing without it")
    return Split(images, labels), classes, seconds


def load_imagefolder(
    data_dir: Path, *, image_size: int, workers: int, cache_dir: Path | None
) -> Data:
    """A ``train/<class>/*`` + ``test/<class>/*`` tree, decoded once (and cached)."""
    train, classes, t1 = _decode_split(data_dir / "train", image_size, workers, cache_dir, "train")
    test, test_classes, t2 = _decode_split(
        data_dir / "test", image_size, workers, cache_dir, "test"
    )
    if test_classes != classes:
        raise DataError(
            f"{data_dir}: train/ has classes {list(classes)} but test/ has {list(test_classes)}"
        )
    return Data(train, test, classes, "imagefolder", False, t1 + t2)


# -- synthetic data -------------------------------------------------------------


def make_fake(
    train_size: int, test_size: int, *, image_size: int = 32, num_classes: int = 10, seed: int = 0
) -> Data:
    """A learnable synthetic set: class templates (smooth colour patterns) plus noise.

    Each class has a random 3x4x4 pattern upsampled to the image size; an image
    is its class pattern with a random brightness offset and per-pixel noise,
    so that classes overlap a little and accuracy is neither 10% nor 100% at once.
    The same arguments always give the same tensors.
    """
    for name, value in (("train_size", train_size), ("test_size", test_size)):
        if value < 1:
            raise DataError(f"--fake-{name.replace('_', '-')} must be >= 1, got {value}")
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand((num_classes, 3, 4, 4), generator=g)
    templates = torch.nn.functional.interpolate(
        coarse, size=(image_size, image_size), mode="bilinear", align_corners=False
    )
    templates = 64.0 + 128.0 * templates  # class means, away from 0 and 255

    def split(n: int) -> Split:
        labels = torch.randint(0, num_classes, (n,), generator=g)
        images = torch.empty((n, 3, image_size, image_size), dtype=torch.uint8)
        for start in range(0, n, 4096):  # bounded float memory
            lab = labels[start : start + 4096]
            k = lab.shape[0]
            x = templates[lab]
            x = x + 40.0 * (torch.rand((k, 1, 1, 1), generator=g) - 0.5)
            x = x + 64.0 * torch.randn((k, 3, image_size, image_size), generator=g)
            images[start : start + k] = x.round().clamp(0, 255).to(torch.uint8)
        return Split(images, labels)

    train = split(train_size)
    test = split(test_size)
    classes = tuple(f"class{i}" for i in range(num_classes))
    return Data(train, test, classes, "fake", True, 0.0)


# -- entry point ---------------------------------------------------------------


def load_data(
    dataset: str,
    data_dir: str | os.PathLike,
    *,
    download: bool = False,
    workers: int = 0,
    cache: bool = True,
    cache_dir: str | os.PathLike | None = None,
    image_size: int = 32,
    fake_train_size: int = 50000,
    fake_test_size: int = 10000,
) -> Data:
    """Loads ``dataset`` (one of :data:`DATASETS`) into memory; see the module docstring.

    Decoded ImageFolder trees are cached in ``cache_dir`` (default
    ``<data_dir>/.decoded``) unless ``cache`` is false.

    Raises:
      DataError: the data cannot be loaded; the message is one line.
    """
    if dataset not in DATASETS:
        raise DataError(f"--dataset must be one of {', '.join(DATASETS)}, got {dataset!r}")
    root = Path(data_dir).expanduser()
    if not cache:
        cache_dir = None
    else:
        cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else root / ".decoded"

    def fake() -> Data:
        return make_fake(fake_train_size, fake_test_size, image_size=image_size)

    if dataset == "cifar10":
        return load_cifar10(root, download=download)
    if dataset == "imagefolder":
        return load_imagefolder(root, image_size=image_size, workers=workers, cache_dir=cache_dir)
    if dataset == "fake":
        return fake()
    # auto
    if has_cifar10(root):
        return load_cifar10(root, download=False)
    if has_imagefolder(root):
        return load_imagefolder(root, image_size=image_size, workers=workers, cache_dir=cache_dir)
    if download:
        try:
            return load_cifar10(root, download=True)
        except DataError as err:
            log(
                f"note: {err}; falling back to SYNTHETIC data (accuracy will not be CIFAR-10 accuracy)"
            )
            return fake()
    log(
        f"note: no CIFAR-10 under {root} (no cifar-10-batches-py/ or train/+test/ folders); "
        "falling back to SYNTHETIC data, so the accuracy is not CIFAR-10 accuracy "
        "(use --download, or --data-dir DIR pointing at the data)"
    )
    return fake()
