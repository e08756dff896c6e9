"""Datasets the trainer reads, never decoded whole; and a quick check the dashboard runs on them.

Torch-free on purpose: the dashboard calls :func:`inspect_dataset` when a user registers a dataset, and
the web process does not install torch. Pillow (images) and scikit-learn (digits) are imported only
when a dataset needs them.

Formats (``data.format`` in the job config):

``builtin``      ``digits``: scikit-learn's bundled 8×8 handwritten digits (1,797 real samples, 10
                 classes), pixels scaled to [0, 1], shape (N, 1, 8, 8). Held in memory (0.5 MB).
``imagefolder``  ``<uri>/<class name>/<image>`` — one sub-folder per class, sorted names give the
                 label ids. If ``<uri>`` holds exactly ``train/`` and ``val/`` (each laid out that way)
                 they are used as the split. Loading keeps only the file list and the labels
                 (:class:`ImageFiles`); each sample is decoded when a batch asks for it (in the
                 trainer's DataLoader workers, ``data.num_workers``): converted to RGB, resized to
                 ``data.image_size`` square, scaled to [0, 1], shape (3, H, W).
``csv``          a header row; the column ``data.label_column`` holds integer labels 0..K-1, every
                 other column is a numeric feature: shape (F,). Parsed once, streaming, into a cache of
                 two ``.npy`` files (features float32 (N, F), labels int64 (N,)) beside the CSV, or in the
                 machine's temporary folder when the CSV's folder is read-only (a cloud's mount; not
                 the run's output folder, which the clouds upload); later runs memory-map the cache.
``npz``          ``x_train`` and ``y_train`` (and optionally ``x_val`` and ``y_val``); x is (N, F),
                 (N, H, W) or (N, C, H, W) — channels first; uint8 x is scaled to [0, 1] per batch.
                 An uncompressed archive (``numpy.savez``) is memory-mapped member by member; one
                 written with ``numpy.savez_compressed`` cannot be, and is loaded whole as float32 (the
                 run's log says so).
``tokens``       a folder of memory-mapped token shards and its ``meta.json`` (:mod:`trainer_pkg.tokens`,
                 made by :mod:`trainer_pkg.prepare_text`), or its ``s3://``/``gs://``/``az://`` prefix:
                 :func:`load_dataset` returns the opened :class:`trainer_pkg.tokens.TokenDataset`,
                 never reading the shards whole.
``webdataset``   a folder or object-store prefix of WebDataset-style ``*.tar`` shards, each holding
                 ``<key>.<image ext>`` images and ``<key>.cls`` integer labels, and optionally a
                 ``val/`` folder of validation shards (without one, the last shard is held out for
                 validation) (:mod:`trainer_pkg.tar_shards`). Each data-parallel rank streams only its
                 own shards — shard i goes to rank i mod the data-parallel size, in an order shuffled
                 per epoch by ``train.seed``, members read in tar order — and the ranks agree on the
                 steps per epoch (the fewest batches any rank's shards hold), so uneven shards never
                 hang a run (:mod:`trainer_pkg.web_shard`). Images are decoded as ImageFolder's, in
                 the DataLoader workers. Classes: those of the validation shards' labels.

Streamed inputs are :class:`Samples` (``take(indices)`` reads and converts only those samples);
labels are always held in memory (int64, 8 bytes a sample). Without an explicit validation split,
``data.val_fraction`` of the samples are held out by a permutation seeded with ``train.seed`` and
applied by index (no copy of the inputs), so every rank (and every rerun) gets the same split.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import fcntl
import hashlib
import io
import os
import struct
import tempfile
import zipfile
from typing import Any, Iterator

import numpy as np

from trainer_pkg import tar_shards
from trainer_pkg.config import ConfigError, DataConfig
from trainer_pkg.tokens import TokenDataset, inspect_tokens, open_tokens

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
# A CSV larger than this is only sampled by check_dataset (header + first rows, line count).
_CSV_FULL_CHECK_BYTES = 32 * 1024 * 1024
_CSV_SAMPLE_ROWS = 1000
_CSV_CHUNK_ROWS = 8192
"""Rows parsed into one array before they are appended to the CSV cache."""
CSV_CACHE_VERSION = 1
"""Part of the cache's key: a change to how a CSV is parsed makes new cache files."""


class Samples:
    """Inputs read on demand: :meth:`take` reads, decodes and converts only the samples asked for.

    Indexing (``samples[:32]``, ``samples[np.array([4, 1])]``, ``samples[3]``) is :meth:`take` of those
    positions. A
    subclass is cheap to copy into DataLoader workers (no decoded data in it).
    """

    sample_shape: tuple[int, ...]
    """Shape of one sample as the model sees it: (C, H, W) or (F,)."""

    def __len__(self) -> int:
        raise NotImplementedError

    @property
    def shape(self) -> tuple[int, ...]:
        """(N, *sample_shape), as an array's."""
        return (len(self), *self.sample_shape)

    def take(self, indices: np.ndarray) -> np.ndarray:
        """Samples ``indices`` ((k,) integers in 0..N-1) as a new float32 array (k, *sample_shape)."""
        raise NotImplementedError

    def subset(self, indices: np.ndarray) -> "Samples":
        """The samples at ``indices`` ((k,) integers), in that order, without reading any of them."""
        raise NotImplementedError

    def __getitem__(self, key: Any) -> np.ndarray:
        positions = np.arange(len(self))[key]
        return self.take(positions) if positions.ndim else self.take(positions.reshape(1))[0]


class ImageFiles(Samples):
    """ImageFolder samples as files: decoded only by :meth:`take`."""

    def __init__(self, paths: np.ndarray, size: int) -> None:
        # Paths as one bytes array, not a list of str: a forked DataLoader worker touching a list's
        # objects (their refcounts) would copy its pages, one copy per worker.
        self.paths = paths
        self.size = size
        self.sample_shape = (3, size, size)

    def __len__(self) -> int:
        return len(self.paths)

    def take(self, indices: np.ndarray) -> np.ndarray:
        out = np.empty((len(indices), *self.sample_shape), dtype=np.float32)
        for i, k in enumerate(indices):
            out[i] = _open_image(os.fsdecode(self.paths[k]), self.size)
        return out

    def subset(self, indices: np.ndarray) -> "ImageFiles":
        return ImageFiles(self.paths[indices], self.size)


class ArrayRows(Samples):
    """Rows of an array (usually a memory map), through an optional index (the split), converted to
    float32 per batch: uint8 scaled to [0, 1] (÷ 255), (N, H, W) given a channel axis (N, 1, H, W)."""

    def __init__(self, array: np.ndarray, rows: np.ndarray | None = None) -> None:
        self.array = array
        """The whole array, (N, ...) of any numeric dtype; never copied."""
        self.rows = rows
        """Which of its rows, in order ((n,) int64); None = all."""
        shape = tuple(int(s) for s in array.shape[1:])
        self.sample_shape = (1, *shape) if len(shape) == 2 else shape

    def __len__(self) -> int:
        return len(self.array) if self.rows is None else len(self.rows)

    def take(self, indices: np.ndarray) -> np.ndarray:
        rows = np.asarray(indices, dtype=np.int64)
        if self.rows is not None:
            rows = self.rows[rows]
        return _prepare_x(np.asarray(self.array[rows]))

    def subset(self, indices: np.ndarray) -> "ArrayRows":
        indices = np.asarray(indices, dtype=np.int64)
        return ArrayRows(self.array, indices if self.rows is None else self.rows[indices])


class TarSamples(Samples):
    """Images inside tar shards, by (shard, byte offset, length): decoded only by :meth:`take`, as
    ImageFolder's (RGB, ``size`` square, [0, 1], (3, size, size))."""

    def __init__(self, paths: np.ndarray, shard: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
                 size: int) -> None:
        self.paths = paths
        """(shards,) bytes: the shard files or object URIs."""
        self.shard, self.offsets, self.lengths = shard, offsets, lengths
        """(N,) int64 each: a sample's shard (index into ``paths``), its image's offset and length."""
        self.size = size
        self.sample_shape = (3, size, size)

    def __len__(self) -> int:
        return len(self.shard)

    def take(self, indices: np.ndarray) -> np.ndarray:
        out = np.empty((len(indices), *self.sample_shape), dtype=np.float32)
        for i, k in enumerate(indices):
            path = os.fsdecode(self.paths[self.shard[k]])
            data = tar_shards.read_bytes(path, int(self.offsets[k]), int(self.lengths[k]))
            out[i] = decode_image(data, self.size, f"{path} at byte {int(self.offsets[k]):,}")
        return out

    def subset(self, indices: np.ndarray) -> "TarSamples":
        return TarSamples(self.paths, self.shard[indices], self.offsets[indices], self.lengths[indices], self.size)


@dataclasses.dataclass(frozen=True)
class WebDataset:
    """A ``webdataset`` as :func:`load_dataset` opens it: the training shards listed (not read:
    each rank indexes its own, :mod:`trainer_pkg.web_shard`), the validation shards indexed."""

    root: str
    train: tuple[tar_shards.TarShard, ...]
    """Training shards in name order; shard i belongs to data-parallel rank i mod dp_size."""
    x_val: TarSamples
    y_val: np.ndarray
    """(N,) int64 validation labels."""
    num_classes: int
    """1 + the largest validation label; a training label at or above it fails the run, named."""
    image_size: int
    notes: tuple[str, ...] = ()

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (3, self.image_size, self.image_size)


def _open_webdataset(uri: str, image_size: int) -> WebDataset:
    root, train, val = tar_shards.list_shards(uri)
    notes = []
    if not val:
        if len(train) < 2:
            raise ConfigError(f"webdataset {root} has one shard and no {tar_shards.VAL_DIR}/ folder: add validation "
                              f"shards under {tar_shards.VAL_DIR}/, or split the data into two or more shards (the "
                              "last is then held out for validation)")
        train, val = train[:-1], train[-1:]
        notes.append(f"webdataset: no {tar_shards.VAL_DIR}/ shards; the last shard {val[0].path} is held out for validation")
    indexes = [tar_shards.index_shard(s) for s in val]
    labels = np.concatenate([ix.labels for ix in indexes])
    x_val = TarSamples(np.array([os.fsencode(s.path) for s in val]),
                       np.concatenate([np.full(len(ix), i, dtype=np.int64) for i, ix in enumerate(indexes)]),
                       np.concatenate([ix.offsets for ix in indexes]), np.concatenate([ix.lengths for ix in indexes]),
                       image_size)
    decode_image(tar_shards.read_bytes(val[0].path, int(x_val.offsets[0]), int(x_val.lengths[0])), 8,
                 val[0].path)  # a missing Pillow or a bad image fails before the run starts
    return WebDataset(root, tuple(train), x_val, labels, int(labels.max()) + 1, image_size, tuple(notes))


@dataclasses.dataclass
class Dataset:
    """A loaded dataset: inputs (float32 arrays, or :class:`Samples` read per batch), int64 labels
    0..num_classes-1."""

    x_train: np.ndarray | Samples
    y_train: np.ndarray
    x_val: np.ndarray | Samples
    y_val: np.ndarray
    num_classes: int
    input_shape: tuple[int, ...]
    """Shape of one sample: (C, H, W) for images, (F,) for tables."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """Lines for the run's log on how the data is read (a cache written, an archive loaded whole)."""

    @property
    def streamed(self) -> bool:
        """Whether the inputs are :class:`Samples`, read per batch, rather than arrays in memory."""
        return isinstance(self.x_train, Samples)


@dataclasses.dataclass(frozen=True)
class TokenData:
    """A ``tokens`` dataset as a language-model job reads it: the opened shards and the window
    length. The trainer draws (B, seq_len) windows from it (:mod:`trainer_pkg.token_shard`)."""

    tokens: TokenDataset
    """The memory-mapped dataset (:func:`load_dataset`'s result for format ``tokens``)."""
    seq_len: int
    """Tokens per window (T): ``data.seq_len``, or the gpt model's ``context_length`` when that is 0
    (:func:`trainer_pkg.registry.seq_len_for`)."""

    @property
    def num_classes(self) -> int:
        """The vocabulary size: the language model's output width."""
        return self.tokens.vocab_size

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One sample: a window of ``seq_len`` token ids."""
        return (self.seq_len,)


def token_data(tokens: TokenDataset, seq_len: int) -> TokenData:
    """``tokens`` read in windows of ``seq_len`` tokens; :class:`ConfigError` when ``seq_len`` is 0
    (a model without a context length, a custom one, was given no ``data.seq_len``)."""
    if seq_len < 1:
        raise ConfigError("data.seq_len: a tokens dataset read by a model without a context length (a custom "
                          "model) needs data.seq_len, the tokens per training window")
    return TokenData(tokens, seq_len)


# -- loading -------------------------------------------------------------------------------------


def load_dataset(data: DataConfig, seed: int = 0, cache_dir: str | None = None) -> Dataset | TokenDataset | WebDataset:
    """Open the dataset ``data`` describes; :class:`ConfigError` with an actionable message if not.

    ``seed`` seeds the train/validation split (use ``train.seed``). ``cache_dir`` is where a CSV's
    parsed cache goes when the CSV's own folder is read-only (default: the system's temporary folder,
    local disk on every platform; SageMaker uploads the output folder and Vertex's is a GCS mount). ImageFolder, CSV and uncompressed NPZ
    inputs come back as :class:`Samples`: nothing of them is decoded here but one image per class.
    A ``tokens`` dataset is opened, not loaded: its shards stay memory-mapped (a dataset without val
    shards holds out the tail ``data.val_fraction`` of its train tokens). A ``webdataset`` is listed
    and its validation shards indexed (:class:`WebDataset`); no training shard is read.
    """
    if data.format == "tokens":
        return open_tokens(data.uri, val_fraction=data.val_fraction)
    if data.format == "webdataset":
        return _open_webdataset(data.uri, data.image_size)
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
            x, y = _image_tree(splits[0], data.image_size, classes)
            xv, yv = _image_tree(splits[1], data.image_size, classes, every_class=False)
            return _split(x, y, xv, yv, data.val_fraction, seed)
        x, y = _image_tree(path, data.image_size, _class_names(path))
        return _split(x, y, None, None, data.val_fraction, seed)
    if data.format == "csv":
        x, y, note = _csv_cached(path, data.label_column, cache_dir)
        ds = _split(ArrayRows(x), y, None, None, data.val_fraction, seed)
        ds.notes.append(note)
        return ds
    if data.format == "npz":
        return _load_npz(path, data.val_fraction, seed)
    raise ConfigError(f"data.format: unknown format {data.format!r} (known: builtin, imagefolder, csv, npz, tokens, webdataset)")


def _split(x, y, x_val, y_val, val_fraction: float, seed: int) -> Dataset:
    """The Dataset of inputs ``x`` (an array or :class:`Samples`) and labels ``y``, with the given
    validation split or (``x_val`` None) one drawn by a seeded permutation, applied by index."""
    if len(x) != len(y):
        raise ConfigError(f"inputs and labels differ in length: {len(x)} samples but {len(y)} labels")
    if x_val is None:
        n = len(x)
        n_val = held_out(n, val_fraction)
        if n < 2 or not 1 <= n_val < n:
            raise ConfigError(
                f"cannot hold out {val_fraction:g} of {n} samples for validation: "
                "add samples or change data.val_fraction"
            )
        order = np.random.default_rng(seed).permutation(n)
        val_idx, train_idx = order[:n_val], order[n_val:]
        if isinstance(x, Samples):
            x, x_val = x.subset(train_idx), x.subset(val_idx)
        else:
            x, x_val = x[train_idx], x[val_idx]
        y, y_val = y[train_idx], y[val_idx]
    elif len(x_val) != len(y_val):
        raise ConfigError(f"x_val has {len(x_val)} samples but y_val has {len(y_val)}")
    if len(x_val) and _sample_shape(x_val) != _sample_shape(x):
        raise ConfigError(f"validation samples have shape {_sample_shape(x_val)}, training samples {_sample_shape(x)}")
    num_classes = int(max(y.max(initial=-1), y_val.max(initial=-1))) + 1
    return Dataset(
        x_train=x if isinstance(x, Samples) else np.ascontiguousarray(x, dtype=np.float32),
        y_train=np.ascontiguousarray(y, dtype=np.int64),
        x_val=x_val if isinstance(x_val, Samples) else np.ascontiguousarray(x_val, dtype=np.float32),
        y_val=np.ascontiguousarray(y_val, dtype=np.int64),
        num_classes=num_classes,
        input_shape=_sample_shape(x),
    )


def _sample_shape(x: np.ndarray | Samples) -> tuple[int, ...]:
    return x.sample_shape if isinstance(x, Samples) else tuple(int(s) for s in x.shape[1:])


DIGITS_FILE = ("sklearn", "datasets", "data", "digits.csv.gz")
"""Where scikit-learn ships the digits data (1,797 rows of 64 pixel values and the class, comma-separated,
gzipped), under its package directory; ``sklearn.datasets.load_digits`` reads the same file."""


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits: ``x`` float32 (1797, 1, 8, 8) in [0, 1], ``y`` int64 (1797,) in 0..9.

    Read from scikit-learn's own data file without importing scikit-learn (whose import, with SciPy's,
    costs each rank about a second of CPU at every start); ``sklearn.datasets.load_digits`` where the
    file is not found. ConfigError when scikit-learn is not installed."""
    data = _digits_csv()
    if data is not None:
        flat, target = data[:, :-1], data[:, -1]
    else:
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            raise ConfigError(
                "the digits dataset needs scikit-learn: pip install 'trainboard-trainer[digits]'"
            ) from None
        bunch = load_digits()
        flat, target = bunch.data, bunch.target
    # Pixel values are 0..16 (counts of set bits in 4×4 blocks of the original 32×32 bitmaps).
    x = (flat.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    return x, target.astype(np.int64)


def _digits_csv() -> np.ndarray | None:
    """The rows of scikit-learn's ``digits.csv.gz`` (float64, (1797, 65)), or None where it is not
    installed there. Finding the package's directory does not import it."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(DIGITS_FILE[0])
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = os.path.join(root, *DIGITS_FILE[1:])
        if os.path.isfile(path):
            return np.loadtxt(path, delimiter=",")
    return None


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
    return decode_image(path, size, path)


def decode_image(source: str | bytes, size: int, name: str) -> np.ndarray:
    """The image file ``source`` (a path, or its bytes) as float32 (3, size, size) in [0, 1]: RGB,
    resized bilinearly. Raises :class:`ConfigError` naming ``name`` when it cannot be decoded."""
    try:
        from PIL import Image
    except ImportError:
        raise ConfigError("image datasets need Pillow: pip install 'trainboard-trainer[images]'") from None
    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as img:
            img = img.convert("RGB").resize((size, size), Image.BILINEAR)
            arr = np.asarray(img, dtype=np.float32) / 255.0
    except (OSError, ValueError) as exc:  # PIL.UnidentifiedImageError is an OSError
        raise ConfigError(f"image {name} cannot be read: {exc}") from None
    return arr.transpose(2, 0, 1)


def _image_tree(root: str, size: int, classes: list[str], every_class: bool = True) -> tuple[ImageFiles, np.ndarray]:
    """The images under ``root`` (not decoded: :class:`ImageFiles` of (3, size, size) samples) and
    their labels (N,); ``every_class`` requires images for each class. The first image of each class
    is decoded here, so a missing Pillow or an unreadable file fails the run before it starts."""
    paths: list[bytes] = []
    ys: list[np.ndarray] = []
    for label, name in enumerate(classes):
        folder = os.path.join(root, name)
        if not os.path.isdir(folder):
            continue  # a class that only the train split has: no validation samples of it
        files = _image_files(folder)
        if not files and every_class:
            raise ConfigError(
                f"imagefolder class folder {folder} has no images ({', '.join(IMAGE_EXTENSIONS)})"
            )
        if files:
            _open_image(files[0], 8)
        paths.extend(os.fsencode(f) for f in files)
        ys.append(np.full(len(files), label, dtype=np.int64))
    if not paths:
        raise ConfigError(f"imagefolder dataset {root} has no images")
    return ImageFiles(np.array(paths), size), np.concatenate(ys)


# -- CSV -----------------------------------------------------------------------------------------


def _read_csv(path: str, label_column: str, max_rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Features (N, F) float32 and labels (N,) int64 from a CSV, held in memory (the dashboard's
    check of a small file, or of the first ``max_rows`` rows)."""
    chunks = list(_csv_chunks(path, label_column, max_rows))
    return np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks])


def _csv_chunks(path: str, label_column: str, max_rows: int | None = None,
                chunk_rows: int = _CSV_CHUNK_ROWS) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The CSV's rows, parsed and checked, as (features (k, F) float32, labels (k,) int64) chunks
    of at most ``chunk_rows`` rows; at most ``max_rows`` rows in all. Raises :class:`ConfigError`
    naming the line and column of the first bad value, or when there are no rows."""
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
        feats: list[list[float]] = []
        labels: list[int] = []
        total = 0
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
                total += 1
                if len(labels) >= chunk_rows:
                    yield np.asarray(feats, dtype=np.float32), np.asarray(labels, dtype=np.int64)
                    feats, labels = [], []
                if max_rows is not None and total >= max_rows:
                    break
        except (csv.Error, UnicodeDecodeError) as exc:
            raise ConfigError(f"CSV {path} is not a readable CSV file: {exc}") from None
    if labels:
        yield np.asarray(feats, dtype=np.float32), np.asarray(labels, dtype=np.int64)
    elif not total:
        raise ConfigError(f"CSV {path} has a header but no data rows")


def _csv_cached(path: str, label_column: str, cache_dir: str | None) -> tuple[np.ndarray, np.ndarray, str]:
    """(features (N, F) float32 memory map, labels (N,) int64, a line for the log) of the CSV at
    ``path``, through its cache: two ``.npy`` files named after the CSV and a key (its path, size,
    modification time, ``label_column`` and :data:`CSV_CACHE_VERSION`), so an edited CSV is parsed
    again. The cache is written beside the CSV, or in ``cache_dir`` when that folder is read-only.

    Ranks on one machine share the work: a lock file makes one parse while the others wait, and
    each file is written under a temporary name and renamed, so a reader never sees half of one.
    """
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{label_column}|"
                         f"{CSV_CACHE_VERSION}".encode()).hexdigest()[:16]
    stem = f"{os.path.basename(path)}.{key}"
    folder = _writable_dir(os.path.dirname(os.path.abspath(path)), cache_dir)
    x_path, y_path = (os.path.join(folder, f"{stem}.{part}.npy") for part in ("features", "labels"))
    lock_path = os.path.join(folder, f"{stem}.lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if os.path.exists(x_path) and os.path.exists(y_path):
            note = f"CSV {path}: read through its cache {x_path} (memory-mapped)"
        else:
            rows = _write_csv_cache(path, label_column, x_path, y_path)
            note = f"CSV {path}: parsed once ({rows:,} rows) into the cache {x_path}, memory-mapped from there"
        # The cache is complete: nothing is left to guard (a rank still waiting on this file finds it
        # complete; at worst two ranks that both saw a failed parse parse again, each renaming atomically).
        with contextlib.suppress(OSError):
            os.unlink(lock_path)
    return np.load(x_path, mmap_mode="r"), np.load(y_path), note


def _writable_dir(beside: str, cache_dir: str | None) -> str:
    """``beside`` when this process may write there, else ``cache_dir`` (created; default: the
    system's temporary folder)."""
    if os.access(beside, os.W_OK | os.X_OK):
        return beside
    folder = cache_dir or os.path.join(tempfile.gettempdir(), "trainboard-csv-cache")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"the CSV's folder {beside} is read-only and its cache folder {folder} cannot be "
                          f"created ({exc.strerror}): make one of them writable") from None
    return folder


def _write_csv_cache(path: str, label_column: str, x_path: str, y_path: str) -> int:
    """Parse the CSV into ``x_path`` (float32 (N, F)) and ``y_path`` (int64 (N,)) chunk by chunk;
    returns N. Nothing is renamed into place unless the whole file parsed."""
    tmp = f".tmp-{os.getpid()}"
    with contextlib.ExitStack() as stack:
        xw = ys = None
        try:
            for feats, labels in _csv_chunks(path, label_column):
                if xw is None:
                    xw = stack.enter_context(NpyAppender(x_path + tmp, np.float32, feats.shape[1:]))
                    ys = stack.enter_context(NpyAppender(y_path + tmp, np.int64, ()))
                xw.append(feats)
                ys.append(labels)
        except BaseException:
            for p in (x_path + tmp, y_path + tmp):
                with contextlib.suppress(OSError):
                    os.unlink(p)
            raise
    os.replace(y_path + tmp, y_path)
    os.replace(x_path + tmp, x_path)  # last: its presence with the labels' marks a complete cache
    return xw.rows


class NpyAppender:
    """A ``.npy`` file written row chunk by row chunk, its length unknown until the end: a header of
    fixed size is reserved, and rewritten with the final shape on close (the ``.npy`` format allows
    a header padded with spaces). A context manager."""

    HEADER_BYTES = 128  # magic, version, length, dict: room for any (N, F) shape

    def __init__(self, path: str, dtype: Any, row_shape: tuple[int, ...]) -> None:
        self.path, self.dtype, self.row_shape = path, np.dtype(dtype), tuple(row_shape)
        self.rows = 0
        self._file = open(path, "wb")
        self._file.write(b"\0" * self.HEADER_BYTES)

    def append(self, chunk: np.ndarray) -> None:
        """Write ``chunk`` ((k, *row_shape)) after the rows so far."""
        chunk = np.ascontiguousarray(chunk, dtype=self.dtype)
        if chunk.shape[1:] != self.row_shape:
            raise ValueError(f"chunk rows have shape {chunk.shape[1:]}, expected {self.row_shape}")
        self._file.write(chunk.tobytes())
        self.rows += len(chunk)

    def close(self) -> None:
        header = repr({"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                       "shape": (self.rows, *self.row_shape)})
        body = header.ljust(self.HEADER_BYTES - 10 - 1).encode("latin1") + b"\n"
        self._file.seek(0)
        self._file.write(np.lib.format.magic(1, 0) + struct.pack("<H", len(body)) + body)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def __enter__(self) -> "NpyAppender":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# -- NPZ -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NpzMember:
    """Where one array of an .npz archive lies."""

    shape: tuple[int, ...]
    dtype: np.dtype
    fortran_order: bool
    stored: bool
    """Uncompressed (``numpy.savez``): its bytes lie as they are in the file, so it can be mapped."""
    data_offset: int
    """Byte offset of the array's data in the .npz file (valid when ``stored``)."""


def _npz_members(path: str) -> dict[str, NpzMember]:
    """Each array of an .npz archive, read from the zip's and the .npy headers, no data loaded.

    An uncompressed member's data offset: the zip's local file header (30 bytes, then the name and
    an extra field whose lengths it gives, APPNOTE.TXT 4.3.7) starts at the central directory's
    ``header_offset``; the member's own .npy header follows it."""
    out = {}
    try:
        with zipfile.ZipFile(path) as zf, open(path, "rb") as raw:
            for info in zf.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                stored = info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 0x1
                with zf.open(info) as member:
                    version = np.lib.format.read_magic(member)
                    shape, fortran, dtype = (np.lib.format.read_array_header_1_0(member) if version == (1, 0)
                                             else np.lib.format.read_array_header_2_0(member))
                    npy_header = member.tell()
                offset = 0
                if stored:
                    raw.seek(info.header_offset)
                    local = raw.read(30)
                    if local[:4] != b"PK\x03\x04":
                        raise zipfile.BadZipFile(f"no local header for {info.filename}")
                    name_len, extra_len = struct.unpack("<HH", local[26:30])
                    offset = info.header_offset + 30 + name_len + extra_len + npy_header
                out[info.filename[: -len(".npy")]] = NpzMember(tuple(shape), dtype, bool(fortran), stored, offset)
    except (zipfile.BadZipFile, OSError, ValueError, struct.error) as exc:
        raise ConfigError(f"NPZ {path} is not a readable .npz archive (numpy.savez): {exc}") from None
    return out


def _npz_headers(path: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shape and dtype of each array in an .npz, read from the headers without loading the data."""
    return {name: (m.shape, m.dtype) for name, m in _npz_members(path).items()}


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
    """Inputs as the model takes them: float32, uint8 scaled to [0, 1], (N, H, W) → (N, 1, H, W)."""
    scale = 255.0 if x.dtype == np.uint8 else 1.0
    x = x.astype(np.float32) / scale
    return x[:, None] if x.ndim == 3 else x


def _load_npz(path: str, val_fraction: float, seed: int) -> Dataset:
    members = _npz_members(path)
    headers = {name: (m.shape, m.dtype) for name, m in members.items()}
    _check_npz_layout(path, headers)
    notes = []
    xs: dict[str, np.ndarray | Samples] = {}
    with np.load(path, allow_pickle=False) as z:
        y = z["y_train"].astype(np.int64)
        yv = z["y_val"].astype(np.int64) if "y_val" in headers else None
        for name in ("x_train", "x_val"):
            m = members.get(name)
            if m is None:
                continue
            if m.stored and not m.dtype.hasobject:
                xs[name] = ArrayRows(np.memmap(path, dtype=m.dtype, mode="r", offset=m.data_offset, shape=m.shape,
                                               order="F" if m.fortran_order else "C"))
            else:
                xs[name] = _prepare_x(z[name])
                notes.append(f"NPZ {path}: {name} is compressed (numpy.savez_compressed), which cannot be "
                             f"memory-mapped: loaded whole ({xs[name].nbytes / 2**20:,.1f} MiB as float32); "
                             "save it with numpy.savez to stream it")
    for name, labels in (("y_train", y), ("y_val", yv)):
        if labels is not None and labels.size and labels.min() < 0:
            raise ConfigError(f"NPZ {path}: {name} has negative labels; use class ids 0, 1, 2, ...")
    ds = _split(xs["x_train"], y, xs.get("x_val"), yv, val_fraction, seed)
    ds.notes.extend(notes)
    return ds


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
    classes: int | None = None
    """Classes of the labels (a sampled CSV: those of the rows read), or a token dataset's vocabulary
    size: the model's output width, which the memory plan counts (:mod:`trainer_pkg.memory_plan`)."""
    samples: int | None = None
    """Samples the data holds, its own validation split included (what ``summary`` counts); None
    when they were only estimated (a sampled CSV, a webdataset) or are not samples (token windows
    are cut per job)."""
    val_samples: int | None = None
    """Samples of the data's own validation split (an NPZ's ``x_val``, an ImageFolder's ``val/``);
    None when the trainer holds out ``data.val_fraction`` of ``samples`` instead
    (:func:`train_split_size`)."""


def held_out(n: int, val_fraction: float) -> int:
    """Samples of ``n`` the trainer holds out for validation when the data has no split of its own."""
    return int(round(n * val_fraction))


def train_split_size(samples: int, val_samples: int | None, val_fraction: float) -> int:
    """Samples of the training split the trainer draws its batches from: ``samples`` less its own
    validation split, or less :func:`held_out` ``val_fraction`` of them (:func:`_split`); e.g.
    digits' 1,797 samples with the default 0.2 → 1,438."""
    return samples - (val_samples if val_samples is not None else held_out(samples, val_fraction))


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
    array headers and labels only, a token dataset maps its shards and reads a few pages of each, a
    webdataset lists its shards and indexes the first one only (:func:`_inspect_webdataset`).
    """
    if format == "tokens":
        info = inspect_tokens(uri)
        return DatasetInfo(info.summary, (None,), info.vocab_size)
    if format == "webdataset":
        return _inspect_webdataset(uri)
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
        return _info(n, classes, shape if len(shape) != 2 else (1, *shape),
                     val_samples=len(labels[1]) if len(labels) > 1 else None)
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
        val = None
        if splits:
            val = sum(len(_image_files(os.path.join(splits[1], c))) for c in classes
                      if os.path.isdir(os.path.join(splits[1], c)))
            n += val
        shown = ", ".join(classes[:5]) + (", ..." if len(classes) > 5 else "")
        return DatasetInfo(f"{n:,} images, {len(classes)} classes ({shown})", (3, None, None), len(classes),
                           samples=n, val_samples=val)
    raise ConfigError(f"unknown dataset format {format!r} (known: builtin, imagefolder, csv, npz, tokens, webdataset)")


def _inspect_webdataset(uri: str) -> DatasetInfo:
    """A webdataset's summary from its listing and the index of its first shard alone (every shard
    is never read: a dataset may hold thousands): the samples are estimated as the first shard's
    count × the training shards' bytes ÷ its bytes, the classes are those seen in it (at least).
    Decodes the first image. Raises :class:`ConfigError` as :func:`trainer_pkg.tar_shards.index_shard`."""
    _, train, val = tar_shards.list_shards(uri)
    first = tar_shards.index_shard(train[0])
    decode_image(tar_shards.read_bytes(train[0].path, int(first.offsets[0]), int(first.lengths[0])), 8, train[0].path)
    total = sum(s.size for s in train)
    about = int(round(len(first) * total / max(train[0].size, 1)))
    classes = int(first.labels.max()) + 1
    n = len(train)
    val_text = (f"validation: {len(val)} shard{'s' if len(val) != 1 else ''} in {tar_shards.VAL_DIR}/" if val else
                f"no {tar_shards.VAL_DIR}/ shards: the last training shard is held out for validation")
    return DatasetInfo(f"about {about:,} samples in {n:,} shard{'s' if n != 1 else ''} (the first holds {len(first):,}, "
                       f"classes 0–{classes - 1} seen in it); {val_text}", (3, None, None), classes)


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
        (int(x.shape[1]),), len(np.unique(y)),
    )


def _info(n: int, classes: int, sample_shape: tuple[int, ...], val_samples: int | None = None) -> DatasetInfo:
    return DatasetInfo(_summary(n, classes, sample_shape), tuple(int(s) for s in sample_shape), int(classes),
                       samples=int(n), val_samples=val_samples)


def _summary(n: int, classes: int, sample_shape: tuple[int, ...]) -> str:
    if len(sample_shape) == 1:
        what = f"{sample_shape[0]} features"
    else:
        what = "inputs " + "×".join(str(s) for s in sample_shape)
    return f"{n:,} samples, {classes} classes, {what}"


def describe(ds: Dataset | TokenDataset | TokenData | WebDataset) -> dict[str, Any]:
    """A small JSON-able summary for logs."""
    if isinstance(ds, WebDataset):
        return {"train_shards": len(ds.train), "val_samples": int(len(ds.y_val)), "num_classes": ds.num_classes,
                "input_shape": list(ds.input_shape)}
    if isinstance(ds, TokenData):
        return {**describe(ds.tokens), "seq_len": ds.seq_len}
    if isinstance(ds, TokenDataset):
        return {"train_tokens": ds.train.num_tokens, "val_tokens": ds.val.num_tokens,
                "train_shards": len(ds.train.shards), "vocab_size": ds.vocab_size, "dtype": ds.dtype}
    return {
        "train_samples": int(len(ds.y_train)),
        "val_samples": int(len(ds.y_val)),
        "num_classes": ds.num_classes,
        "input_shape": list(ds.input_shape),
        "read": "per batch" if ds.streamed else "in memory",
    }
