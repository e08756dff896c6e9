"""Datasets the trainer reads, as plain numpy arrays; and a quick check the dashboard runs on them.

Torch-free on purpose: the dashboard calls :func:`inspect_dataset` when a user registers a dataset, and
the web process does not install torch. Pillow (images) and scikit-learn (digits) are imported only
when a dataset needs them.

Formats (``data.format`` in the job config):

``builtin``      ``digits``: scikit-learn's bundled 8×8 handwritten digits (1,797 real samples, 10
                 classes), pixels scaled to [0, 1], shape (N, 1, 8, 8).
``imagefolder``  ``<uri>/<class name>/<image>`` — one sub-folder per class, sorted names give the
                 label ids. If ``<uri>`` holds exactly ``train/`` and ``val/`` (each laid out that way)
                 they are used as the split. Images are converted to RGB, resized to
                 ``data.image_size`` square, scaled to [0, 1]: shape (N, 3, H, W).
``csv``          a header row; the column ``data.label_column`` holds integer labels 0..K-1, every
                 other column is a numeric feature: shape (N, F).
``npz``          ``x_train`` and ``y_train`` (and optionally ``x_val`` and ``y_val``); x is (N, F),
                 (N, H, W) or (N, C, H, W) — channels first; uint8 x is scaled to [0, 1].
``tokens``       a folder of memory-mapped token shards and its ``meta.json`` (:mod:`trainer_pkg.tokens`,
                 made by :mod:`trainer_pkg.prepare_text`): :func:`load_dataset` returns the opened
                 :class:`trainer_pkg.tokens.TokenDataset`, never reading the shards whole.

Without an explicit validation split, ``data.val_fraction`` of the samples are held out by a
permutation seeded with ``train.seed``, so every rank (and every rerun) gets the same split.
"""

from __future__ import annotations

import csv
import dataclasses
import os
import zipfile
from typing import Any

import numpy as np

from trainer_pkg.config import ConfigError, DataConfig
from trainer_pkg.tokens import TokenDataset, inspect_tokens, open_tokens

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
# A CSV larger than this is only sampled by check_dataset (header + first rows, line count).
_CSV_FULL_CHECK_BYTES = 32 * 1024 * 1024
_CSV_SAMPLE_ROWS = 1000


@dataclasses.dataclass
class Dataset:
    """A loaded dataset: float32 inputs, int64 labels 0..num_classes-1."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    num_classes: int
    input_shape: tuple[int, ...]
    """Shape of one sample: (C, H, W) for images, (F,) for tables."""


# -- loading -------------------------------------------------------------------------------------


def load_dataset(data: DataConfig, seed: int = 0) -> Dataset | TokenDataset:
    """Load the dataset ``data`` describes; :class:`ConfigError` with an actionable message if not.

    ``seed`` seeds the train/validation split (use ``train.seed``). A ``tokens`` dataset is opened,
    not loaded: its shards stay memory-mapped (a dataset without val shards holds out the tail
    ``data.val_fraction`` of its train tokens).
    """
    if data.format == "tokens":
        return open_tokens(data.uri, val_fraction=data.val_fraction)
    if data.format == "builtin":
        if data.name != "digits":
            raise ConfigError(f"data.name: unknown built-in dataset {data.name!r} (known: digits)")
        x, y = _load_digits()
        return _split(x, y, None, None, data.val_fraction, seed)
    path = _local_path(data.format, data.uri)
    if data.format == "imagefolder":
        splits = _imagefolder_splits(path)
        if splits is not None:
            classes = _class_names(splits[0])
            x, y = _load_image_tree(splits[0], data.image_size, classes)
            xv, yv = _load_image_tree(splits[1], data.image_size, classes, every_class=False)
            return _split(x, y, xv, yv, data.val_fraction, seed)
        x, y = _load_image_tree(path, data.image_size, _class_names(path))
        return _split(x, y, None, None, data.val_fraction, seed)
    if data.format == "csv":
        x, y = _read_csv(path, data.label_column)
        return _split(x, y, None, None, data.val_fraction, seed)
    if data.format == "npz":
        return _load_npz(path, data.val_fraction, seed)
    raise ConfigError(f"data.format: unknown format {data.format!r} (known: builtin, imagefolder, csv, npz, tokens)")


def _split(x, y, x_val, y_val, val_fraction: float, seed: int) -> Dataset:
    if len(x) != len(y):
        raise ConfigError(f"inputs and labels differ in length: {len(x)} samples but {len(y)} labels")
    if x_val is None:
        n = len(x)
        n_val = int(round(n * val_fraction))
        if n < 2 or not 1 <= n_val < n:
            raise ConfigError(
                f"cannot hold out {val_fraction:g} of {n} samples for validation: "
                "add samples or change data.val_fraction"
            )
        order = np.random.default_rng(seed).permutation(n)
        val_idx, train_idx = order[:n_val], order[n_val:]
        x, y, x_val, y_val = x[train_idx], y[train_idx], x[val_idx], y[val_idx]
    elif len(x_val) != len(y_val):
        raise ConfigError(f"x_val has {len(x_val)} samples but y_val has {len(y_val)}")
    if len(x_val) and x_val.shape[1:] != x.shape[1:]:
        raise ConfigError(f"validation samples have shape {x_val.shape[1:]}, training samples {x.shape[1:]}")
    num_classes = int(max(y.max(initial=-1), y_val.max(initial=-1))) + 1
    return Dataset(
        x_train=np.ascontiguousarray(x, dtype=np.float32),
        y_train=np.ascontiguousarray(y, dtype=np.int64),
        x_val=np.ascontiguousarray(x_val, dtype=np.float32),
        y_val=np.ascontiguousarray(y_val, dtype=np.int64),
        num_classes=num_classes,
        input_shape=tuple(int(s) for s in x.shape[1:]),
    )


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ConfigError(
            "the digits dataset needs scikit-learn: pip install 'trainboard-trainer[digits]'"
        ) from None
    bunch = load_digits()
    # Pixel values are 0..16 (counts of set bits in 4×4 blocks of the original 32×32 bitmaps).
    x = (bunch.data.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    return x, bunch.target.astype(np.int64)


def _local_path(fmt: str, uri: str) -> str:
    """The local filesystem path behind ``uri``, checked to exist and be readable."""
    if not uri:
        raise ConfigError(f"data.uri: a {fmt} dataset needs a path")
    path = uri[len("file://"):] if uri.startswith("file://") else uri
    if "://" in path:
        raise ConfigError(
            f"{fmt} dataset {uri} is not a local path: the trainer reads the mount or channel path "
            "the platform provides (e.g. /opt/ml/input/data/train); pass that path instead"
        )
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise ConfigError(f"{fmt} dataset path {path} does not exist: check the path or upload the data there")
    if not os.access(path, os.R_OK) or (os.path.isdir(path) and not os.access(path, os.X_OK)):
        raise ConfigError(f"{fmt} dataset path {path} is not readable by this process: fix its permissions")
    want_dir = fmt == "imagefolder"
    if want_dir and not os.path.isdir(path):
        raise ConfigError(f"imagefolder dataset {path} is a file: give the folder that holds one sub-folder per class")
    if not want_dir and os.path.isdir(path):
        raise ConfigError(f"{fmt} dataset {path} is a folder: give the path of the .{fmt} file itself")
    return path


# -- ImageFolder -------------------------------------------------------------------------------


def _imagefolder_splits(root: str) -> tuple[str, str] | None:
    """(train, val) folders when ``root`` holds exactly ``train/`` and ``val/``, else None."""
    subdirs = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if subdirs == ["train", "val"]:
        return os.path.join(root, "train"), os.path.join(root, "val")
    return None


def _class_names(root: str) -> list[str]:
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise ConfigError(
            f"imagefolder dataset {root} has no class sub-folders: lay it out as {root}/<class>/<image>.png"
        )
    return classes


def _image_files(folder: str) -> list[str]:
    return sorted(
        os.path.join(folder, e.name)
        for e in os.scandir(folder)
        if e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS)
    )


def _open_image(path: str, size: int) -> np.ndarray:
    """One image as float32 (3, size, size) in [0, 1]."""
    try:
        from PIL import Image
    except ImportError:
        raise ConfigError("imagefolder datasets need Pillow: pip install 'trainboard-trainer[images]'") from None
    try:
        with Image.open(path) as img:
            img = img.convert("RGB").resize((size, size), Image.BILINEAR)
            arr = np.asarray(img, dtype=np.float32) / 255.0
    except (OSError, ValueError) as exc:  # PIL.UnidentifiedImageError is an OSError
        raise ConfigError(f"image {path} cannot be read: {exc}") from None
    return arr.transpose(2, 0, 1)


def _load_image_tree(
    root: str, size: int, classes: list[str], every_class: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 3, size, size) and labels (N,); ``every_class`` requires images for each class."""
    xs, ys = [], []
    for label, name in enumerate(classes):
        folder = os.path.join(root, name)
        if not os.path.isdir(folder):
            continue  # a class that only the train split has: no validation samples of it
        files = _image_files(folder)
        if not files and every_class:
            raise ConfigError(
                f"imagefolder class folder {folder} has no images ({', '.join(IMAGE_EXTENSIONS)})"
            )
        for f in files:
            xs.append(_open_image(f, size))
            ys.append(label)
    if not xs:
        raise ConfigError(f"imagefolder dataset {root} has no images")
    return np.stack(xs), np.asarray(ys, dtype=np.int64)


# -- CSV -----------------------------------------------------------------------------------------


def _read_csv(path: str, label_column: str, max_rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Features (N, F) float32 and labels (N,) int64 from a CSV; reads at most ``max_rows`` rows."""
    try:
        f = open(path, newline="", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"CSV {path} cannot be opened: {exc.strerror}") from None
    with f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise ConfigError(f"CSV {path} is empty: it needs a header row and one row per sample") from None
        except (csv.Error, UnicodeDecodeError) as exc:
            raise ConfigError(f"CSV {path} is not a readable CSV file: {exc}") from None
        header = [h.strip() for h in header]
        if label_column not in header:
            raise ConfigError(
                f"CSV {path} has no column {label_column!r} (columns: {', '.join(header)}); "
                "set data.label_column to the column that holds the class label"
            )
        if len(header) < 2:
            raise ConfigError(f"CSV {path} has only the label column {label_column!r}: it needs feature columns too")
        li = header.index(label_column)
        feats, labels = [], []
        try:
            for row in reader:
                if not row or all(not c.strip() for c in row):
                    continue
                line = reader.line_num
                if len(row) != len(header):
                    raise ConfigError(
                        f"CSV {path} line {line} has {len(row)} fields, the header has {len(header)}"
                    )
                try:
                    values = [float(c) for c in row]
                except ValueError:
                    bad = next(i for i, c in enumerate(row) if not _is_number(c))
                    raise ConfigError(
                        f"CSV {path} line {line}, column {header[bad]!r}: {row[bad]!r} is not a number"
                    ) from None
                label = values.pop(li)
                if not label.is_integer() or label < 0:
                    raise ConfigError(
                        f"CSV {path} line {line}: label {row[li]!r} in column {label_column!r} "
                        "must be an integer class id 0, 1, 2, ..."
                    )
                labels.append(int(label))
                feats.append(values)
                if max_rows is not None and len(labels) >= max_rows:
                    break
        except (csv.Error, UnicodeDecodeError) as exc:
            raise ConfigError(f"CSV {path} is not a readable CSV file: {exc}") from None
    if not labels:
        raise ConfigError(f"CSV {path} has a header but no data rows")
    return np.asarray(feats, dtype=np.float32), np.asarray(labels, dtype=np.int64)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# -- NPZ -----------------------------------------------------------------------------------------


def _npz_headers(path: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shape and dtype of each array in an .npz, read from the headers without loading the data."""
    out = {}
    try:
        with zipfile.ZipFile(path) as zf:
            for name in zf.namelist():
                if not name.endswith(".npy"):
                    continue
                with zf.open(name) as member:
                    version = np.lib.format.read_magic(member)
                    if version == (1, 0):
                        shape, _, dtype = np.lib.format.read_array_header_1_0(member)
                    else:
                        shape, _, dtype = np.lib.format.read_array_header_2_0(member)
                out[name[: -len(".npy")]] = (tuple(shape), dtype)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise ConfigError(f"NPZ {path} is not a readable .npz archive (numpy.savez): {exc}") from None
    return out


def _check_npz_layout(path: str, headers: dict[str, tuple[tuple[int, ...], np.dtype]]) -> None:
    missing = [k for k in ("x_train", "y_train") if k not in headers]
    if missing:
        raise ConfigError(
            f"NPZ {path} has no {' or '.join(missing)} (arrays: {', '.join(sorted(headers)) or 'none'}); "
            "save it with numpy.savez(path, x_train=..., y_train=..., [x_val=..., y_val=...])"
        )
    if ("x_val" in headers) != ("y_val" in headers):
        raise ConfigError(f"NPZ {path} has only one of x_val and y_val: give both or neither")
    for split in ("train", "val"):
        if f"x_{split}" not in headers:
            continue
        xs, xd = headers[f"x_{split}"]
        ys, yd = headers[f"y_{split}"]
        if len(xs) not in (2, 3, 4):
            raise ConfigError(f"NPZ {path}: x_{split} has shape {xs}; expected (N, F), (N, H, W) or (N, C, H, W)")
        if len(ys) != 1:
            raise ConfigError(f"NPZ {path}: y_{split} has shape {ys}; expected (N,) integer labels")
        if xs[0] != ys[0]:
            raise ConfigError(f"NPZ {path}: x_{split} has {xs[0]} samples but y_{split} has {ys[0]}")
        if not (np.issubdtype(yd, np.integer)):
            raise ConfigError(f"NPZ {path}: y_{split} has dtype {yd}; labels must be integers 0, 1, 2, ...")
        if not (np.issubdtype(xd, np.number) or np.issubdtype(xd, np.bool_)):
            raise ConfigError(f"NPZ {path}: x_{split} has dtype {xd}; inputs must be numeric")


def _prepare_x(x: np.ndarray) -> np.ndarray:
    scale = 255.0 if x.dtype == np.uint8 else 1.0
    x = x.astype(np.float32) / scale
    return x[:, None] if x.ndim == 3 else x  # (N, H, W) → (N, 1, H, W)


def _load_npz(path: str, val_fraction: float, seed: int) -> Dataset:
    headers = _npz_headers(path)
    _check_npz_layout(path, headers)
    with np.load(path, allow_pickle=False) as z:
        x, y = _prepare_x(z["x_train"]), z["y_train"].astype(np.int64)
        xv = _prepare_x(z["x_val"]) if "x_val" in headers else None
        yv = z["y_val"].astype(np.int64) if "y_val" in headers else None
    for name, labels in (("y_train", y), ("y_val", yv)):
        if labels is not None and labels.size and labels.min() < 0:
            raise ConfigError(f"NPZ {path}: {name} has negative labels; use class ids 0, 1, 2, ...")
    return _split(x, y, xv, yv, val_fraction, seed)


# -- the dashboard's check -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """What :func:`inspect_dataset` read from a registered dataset."""

    summary: str
    """One line for the user, e.g. ``"1,797 samples, 10 classes, inputs 1×8×8"``."""
    sample_shape: tuple[int | None, ...]
    """Shape of one sample as the trainer feeds it to the model: (C, H, W) for images, (F,) for
    tables, (T,) for tokens. ImageFolder's H and W are None: the job's ``data.image_size`` sets them;
    a token window's T is None: the job's ``data.seq_len`` sets it."""


def check_dataset(format: str, uri: str, label_column: str = "label") -> str:
    """Open a registered dataset and return a one-line summary, e.g. ``"1,797 samples, 10 classes, 64 features"``.

    Raises :class:`ConfigError` as :func:`inspect_dataset`, whose ``summary`` this is.
    """
    return inspect_dataset(format, uri, label_column).summary


def inspect_dataset(format: str, uri: str, label_column: str = "label") -> DatasetInfo:
    """Open a registered dataset: its one-line summary and the shape of one sample.

    Raises :class:`ConfigError` with a message the user can act on when the path does not exist, is
    not readable, or does not hold data in ``format``. Quick on big data: a large CSV is sampled
    (header, first rows, line count), an ImageFolder opens one image per class, an NPZ reads its
    array headers and labels only, a token dataset maps its shards and reads a few pages of each.
    """
    if format == "tokens":
        return DatasetInfo(inspect_tokens(uri).summary, (None,))
    if format == "builtin":
        name = uri or "digits"
        if name != "digits":
            raise ConfigError(f"unknown built-in dataset {name!r} (known: digits)")
        x, y = _load_digits()
        return _info(len(y), len(np.unique(y)), x.shape[1:])
    path = _local_path(format, uri)
    if format == "csv":
        return _check_csv(path, label_column)
    if format == "npz":
        headers = _npz_headers(path)
        _check_npz_layout(path, headers)
        with np.load(path, allow_pickle=False) as z:
            labels = [z["y_train"]] + ([z["y_val"]] if "y_val" in headers else [])
        n = sum(len(lab) for lab in labels)
        classes = len(np.unique(np.concatenate(labels)))
        shape = headers["x_train"][0][1:]
        return _info(n, classes, shape if len(shape) != 2 else (1, *shape))
    if format == "imagefolder":
        splits = _imagefolder_splits(path)
        root = splits[0] if splits else path
        classes = _class_names(root)
        n = 0
        for name in classes:
            files = _image_files(os.path.join(root, name))
            if not files:
                raise ConfigError(
                    f"imagefolder class folder {os.path.join(root, name)} has no images "
                    f"({', '.join(IMAGE_EXTENSIONS)})"
                )
            _open_image(files[0], 8)  # really decode one image per class
            n += len(files)
        if splits:
            n += sum(len(_image_files(os.path.join(splits[1], c))) for c in classes
                     if os.path.isdir(os.path.join(splits[1], c)))
        shown = ", ".join(classes[:5]) + (", ..." if len(classes) > 5 else "")
        return DatasetInfo(f"{n:,} images, {len(classes)} classes ({shown})", (3, None, None))
    raise ConfigError(f"unknown dataset format {format!r} (known: builtin, imagefolder, csv, npz, tokens)")


def _check_csv(path: str, label_column: str) -> DatasetInfo:
    if os.path.getsize(path) <= _CSV_FULL_CHECK_BYTES:
        x, y = _read_csv(path, label_column)
        return _info(len(y), len(np.unique(y)), x.shape[1:])
    x, y = _read_csv(path, label_column, max_rows=_CSV_SAMPLE_ROWS)
    with open(path, "rb") as f:
        lines = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    return DatasetInfo(
        f"about {max(lines - 1, len(y)):,} samples, {x.shape[1]} features "
        f"(first {len(y):,} rows checked: {len(np.unique(y))} classes)",
        (int(x.shape[1]),),
    )


def _info(n: int, classes: int, sample_shape: tuple[int, ...]) -> DatasetInfo:
    return DatasetInfo(_summary(n, classes, sample_shape), tuple(int(s) for s in sample_shape))


def _summary(n: int, classes: int, sample_shape: tuple[int, ...]) -> str:
    if len(sample_shape) == 1:
        what = f"{sample_shape[0]} features"
    else:
        what = "inputs " + "×".join(str(s) for s in sample_shape)
    return f"{n:,} samples, {classes} classes, {what}"


def describe(ds: Dataset | TokenDataset) -> dict[str, Any]:
    """A small JSON-able summary for logs."""
    if isinstance(ds, TokenDataset):
        return {"train_tokens": ds.train.num_tokens, "val_tokens": ds.val.num_tokens,
                "train_shards": len(ds.train.shards), "vocab_size": ds.vocab_size, "dtype": ds.dtype}
    return {
        "train_samples": int(len(ds.y_train)),
        "val_samples": int(len(ds.y_val)),
        "num_classes": ds.num_classes,
        "input_shape": list(ds.input_shape),
    }
