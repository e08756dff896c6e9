"""Token datasets: shards of token ids on disk, memory-mapped, never read whole.

Torch-free (numpy only): the dashboard opens the same files to check a registered dataset.

Layout of a token dataset directory (what ``prepare_text`` writes)::

    <root>/meta.json          {"format": "trainboard-tokens", "version": 1, "dtype": "uint16",
                               "vocab_size": 8192, "tokenizer": "tokenizer.json",
                               "splits": {"train": ["train/000000.bin", ...], "val": ["val/000000.bin"]}}
    <root>/train/000000.bin   raw little-endian token ids of ``dtype`` (uint16 or uint32), or a .npy
    <root>/val/000000.bin
    <root>/tokenizer.json     the tokenizer the shards were made with (optional)

:func:`open_tokens` maps every shard with ``numpy.memmap`` (``.bin``) or ``numpy.load(mmap_mode="r")``
(``.npy``): opening a dataset of any size costs a few pages per shard, and a window read touches
only the pages it spans.

The same dataset may live under an object-store prefix (``s3://bucket/tokens``, ``gs://…``,
``az://container/…``: :mod:`trainer_pkg.objstore`): ``meta.json`` is fetched once, the shards' sizes
come from one listing of the prefix (no shard is read whole, none is downloaded), and every window
is one ranged GET of its ``(seq_len + 1) × itemsize`` bytes, the same bytes a local ``pread`` reads.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from typing import Any

import numpy as np

from trainer_pkg import objstore
from trainer_pkg.config import ConfigError

META_NAME = "meta.json"
META_FORMAT = "trainboard-tokens"
TOKEN_DTYPES = ("uint16", "uint32")
SHARD_EXTENSIONS = (".bin", ".npy")


@dataclasses.dataclass(frozen=True)
class TokenStream:
    """One split: its shards in order, each a 1-D memory-mapped array of token ids."""

    shards: tuple[np.ndarray | "RemoteShard", ...]
    """(tokens,) uint16/uint32 memmaps, one per file (a :class:`RemoteShard` per object of a
    dataset on object storage: its length and dtype); never copied whole."""
    paths: tuple[str, ...]
    """The shard files, absolute (object URIs for object storage), in the same order."""
    offsets: tuple[int, ...] = ()
    """Byte offset in its file of each shard's first token (a .npy's header, a held-out tail's
    start); () = 0 for every shard."""

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.shards)

    def window(self, shard: int, start: int, length: int) -> np.ndarray:
        """Tokens ``start … start + length − 1`` of shard ``shard`` as a new int64 array (length,).
        Raises IndexError when the window runs past the shard's end.

        Read from the file (one ``pread``), not through the memory map: a page touched through a
        map stays mapped, and counts in the process's resident set until it is unmapped, so random
        windows over a large map would grow a rank's RSS towards the dataset's size (nanoGPT
        re-creates its memmap every batch for the same reason). The page cache still serves
        repeated reads, and the kernel can drop it under memory pressure."""
        s = self.shards[shard]
        if start < 0 or start + length > len(s):
            raise IndexError(f"window {start}+{length} outside shard {self.paths[shard]} of {len(s)} tokens")
        return _read(self.paths[shard], s.dtype, (self.offsets[shard] if self.offsets else 0)
                     + start * s.dtype.itemsize, length).astype(np.int64)


# Open shard files, by path, for _read: a window is one pread, not an open, a read and a close.
# Bounded, so a dataset of many thousands of shards never exhausts the process's file descriptors.
_OPEN_SHARDS: dict[str, int] = {}
_MAX_OPEN_SHARDS = 128


def _fd(path: str) -> int:
    fd = _OPEN_SHARDS.get(path)
    if fd is None:
        if len(_OPEN_SHARDS) >= _MAX_OPEN_SHARDS:
            os.close(_OPEN_SHARDS.pop(next(iter(_OPEN_SHARDS))))  # the longest open
        fd = _OPEN_SHARDS[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    return fd


@dataclasses.dataclass(frozen=True)
class RemoteShard:
    """A shard on object storage, as much of a memmap as :class:`TokenStream` uses: its length in
    tokens and dtype, sliced like an array (a view: the bytes stay in the bucket)."""

    length: int
    """Tokens in the shard."""
    dtype: np.dtype
    offset: int = 0
    """Byte offset of its first token in the object (a .npy's header)."""

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: slice) -> "RemoteShard":
        return RemoteShard(len(range(self.length)[key]), self.dtype, self.offset)


# Bytes read from a remote .npy's start to find its header (version 1/2 headers of a 1-D array
# are 128 bytes: numpy pads them to a multiple of 64).
_NPY_HEAD_BYTES = 4096


def _remote_shard(uri: str, sizes: dict[str, int], dtype: str, itemsize: int, errors: list[str]) -> RemoteShard | None:
    """The shard object ``uri`` sized from the listing ``sizes`` (a .npy: its header read by one
    ranged GET); None, with the problem appended to ``errors``, when it is missing or malformed."""
    size = sizes.get(uri)
    if size is None:
        errors.append(f"shard {uri} listed in meta.json does not exist (no such object under the prefix)")
        return None
    offset = 0
    if uri.endswith(".npy"):
        head = io.BytesIO(objstore.read(uri, 0, min(size, _NPY_HEAD_BYTES)))
        try:
            version = np.lib.format.read_magic(head)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, _, npy_dtype = read_header(head)
        except (ValueError, OSError) as exc:
            errors.append(f"shard {uri} is not a readable .npy file: {exc}")
            return None
        if len(shape) != 1 or npy_dtype != np.dtype(dtype):
            errors.append(f"shard {uri} holds {npy_dtype} of shape {shape}; meta.json says 1-D {dtype}")
            return None
        offset = head.tell()
        size -= offset
        if size < shape[0] * itemsize:
            errors.append(f"shard {uri} is truncated: its header says {shape[0]:,} tokens, it holds {size // itemsize:,}")
            return None
        size = shape[0] * itemsize
    if size % itemsize:
        errors.append(f"shard {uri} has {size:,} bytes, not a whole number of {dtype} tokens "
                      f"({itemsize} bytes each): it is truncated, or meta.json's dtype is wrong")
        return None
    return RemoteShard(size // itemsize, np.dtype(dtype), offset)


def _read(path: str, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
    """``count`` tokens of ``dtype`` from ``path`` at byte ``offset``, read (not mapped): one
    ``pread`` of a local file, one ranged GET of an object (``s3://``, ``gs://``, ``az://``)."""
    want = count * dtype.itemsize
    data = objstore.read(path, offset, want) if objstore.is_remote(path) else os.pread(_fd(path), want, offset)
    if len(data) != want:
        raise OSError(f"shard {path} ended after {len(data) // dtype.itemsize} of {count} tokens at byte "
                      f"{offset:,}: was it truncated?")
    return np.frombuffer(data, dtype=dtype)


@dataclasses.dataclass(frozen=True)
class TokenDataset:
    """An opened token dataset (:func:`open_tokens`)."""

    root: str
    vocab_size: int
    """Token ids are 0 … vocab_size − 1: the language model's output width (``num_classes``)."""
    dtype: str
    train: TokenStream
    val: TokenStream
    tokenizer: str
    """Path of the tokenizer file beside the shards, or "" when there is none."""
    meta: dict[str, Any]


def _local_root(uri: str) -> str:
    """The dataset's root: an absolute local path, or an object-store prefix without its final slash."""
    path = uri[len("file://"):] if uri.startswith("file://") else uri
    if not path:
        raise ConfigError("data.uri: a tokens dataset needs the path of its folder (the one holding meta.json)")
    if objstore.is_remote(path):
        objstore.split_uri(path)  # names a bucket
        return path.rstrip("/")
    if "://" in path:
        raise ConfigError(f"tokens dataset {uri} is neither a local path nor an s3://, gs:// or az:// prefix: "
                          "pass the mount or channel path the platform provides (e.g. /opt/ml/input/data/train) "
                          "or the dataset's object-store prefix")
    return os.path.abspath(os.path.expanduser(path))


def _read_meta(root: str, meta_path: str) -> Any:
    """meta.json's parsed JSON; FileNotFoundError when there is none."""
    if objstore.is_remote(root):
        return json.loads(objstore.read(meta_path).decode("utf-8"))
    with open(meta_path, encoding="utf-8") as f:
        return json.load(f)


def open_tokens(uri: str, *, val_fraction: float | None = None) -> TokenDataset:
    """Open the token dataset at the local directory ``uri`` (its ``meta.json`` and shards), mapping
    every shard; nothing is read but a few pages per shard.

    A dataset whose ``meta.json`` lists no ``val`` shards (or an empty list) is validated on the
    tail of its train split: the last ``val_fraction`` of the train tokens (``data.val_fraction``),
    which training then leaves out. With ``val_fraction`` None such a dataset is refused.

    Raises :class:`ConfigError` naming the file and what to do when the directory, its ``meta.json``
    or a shard is missing or malformed (every bad shard at once), when the dtype is not
    uint16/uint32, when a shard's first or last tokens are not below ``vocab_size``, or when a split
    is empty.
    """
    root = _local_root(uri)
    remote = objstore.is_remote(root)
    meta_path = objstore.join(root, META_NAME) if remote else os.path.join(root, META_NAME)
    if not remote and not os.path.isdir(root):
        what = "does not exist" if not os.path.exists(root) else "is a file, not a directory"
        raise ConfigError(f"tokens dataset {root} {what}: give the folder holding {META_NAME} "
                          "(made by python -m trainer_pkg.prepare_text)")
    try:
        meta = _read_meta(root, meta_path)
    except FileNotFoundError:
        raise ConfigError(f"tokens dataset {root} has no {META_NAME}: make the dataset with "
                          "python -m trainer_pkg.prepare_text, or write its meta.json (docs/token-data.md)") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{meta_path} cannot be read as JSON: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT:
        raise ConfigError(f"{meta_path} is not a Trainboard token dataset: it needs \"format\": {META_FORMAT!r}")
    if meta.get("version", 1) != 1:
        raise ConfigError(f"{meta_path} has version {meta.get('version')!r}; this trainer reads version 1: "
                          "remake the dataset with this version's prepare_text")
    dtype, vocab = meta.get("dtype"), meta.get("vocab_size")
    if dtype not in TOKEN_DTYPES:
        raise ConfigError(f"{meta_path}: dtype must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not 2 <= vocab <= np.iinfo(dtype).max + 1:
        raise ConfigError(f"{meta_path}: vocab_size must be an integer from 2 to {np.iinfo(dtype).max + 1:,} "
                          f"for {dtype} tokens, got {vocab!r}")
    splits = meta.get("splits")
    if not isinstance(splits, dict):
        raise ConfigError(f"{meta_path}: \"splits\" must be an object listing the shard files of \"train\" "
                          "(and \"val\")")
    errors: list[str] = []
    # Object storage: every shard's size from one listing of the prefix, not a request per shard.
    sizes = _listing(root) if remote else None
    train = _open_split(root, meta_path, "train", splits.get("train"), dtype, vocab, errors, sizes)
    if splits.get("val") in (None, []):
        val = None
        if val_fraction is None:
            errors.append(f"{meta_path} lists no val shards: list some under splits.val (prepare_text "
                          "makes them), or let the trainer hold out data.val_fraction of the train tokens")
    else:
        val = _open_split(root, meta_path, "val", splits.get("val"), dtype, vocab, errors, sizes)
    if errors:
        shown = errors[:8] + ([f"and {len(errors) - 8} more"] if len(errors) > 8 else [])
        raise ConfigError("; ".join(shown))
    if val is None:
        train, val = _hold_out_tail(train, val_fraction, meta_path)
    tokenizer = meta.get("tokenizer") or ""
    tokenizer = (objstore.join(root, tokenizer) if remote else os.path.join(root, tokenizer)) if tokenizer else ""
    return TokenDataset(root=root, vocab_size=vocab, dtype=dtype, train=train, val=val, tokenizer=tokenizer, meta=meta)


def _listing(root: str) -> dict[str, int]:
    """{object URI: bytes} of every object under the prefix ``root``."""
    s, key = objstore.store(root)
    return {s.uri(k): size for k, size in s.list(key + "/" if key else "").items()}


def _hold_out_tail(train: TokenStream, val_fraction: float, meta_path: str) -> tuple[TokenStream, TokenStream]:
    """(train without its tail, the tail): the last ``val_fraction`` of the train tokens (views of
    the same memory maps, possibly spanning shards), for a dataset without a val split."""
    total = train.num_tokens
    n_val = int(round(total * val_fraction))
    if not 0 < val_fraction < 1 or n_val < 2 or total - n_val < 2:
        raise ConfigError(f"{meta_path} lists no val shards and data.val_fraction {val_fraction:g} of its "
                          f"{total:,} train tokens leaves no validation tokens or no training ones: list val "
                          "shards under splits.val or change data.val_fraction")
    keep, seen = total - n_val, 0
    head: list[tuple[np.ndarray, str, int]] = []
    tail: list[tuple[np.ndarray, str, int]] = []
    for i, (shard, path) in enumerate(zip(train.shards, train.paths)):
        base = train.offsets[i] if train.offsets else 0
        cut = min(max(keep - seen, 0), len(shard))
        if cut >= 2:
            head.append((shard[:cut], path, base))
        if len(shard) - cut >= 2:
            tail.append((shard[cut:], path, base + cut * shard.dtype.itemsize))
        seen += len(shard)
    return _stream(head), _stream(tail)


def _stream(parts: list[tuple[np.ndarray, str, int]]) -> TokenStream:
    return TokenStream(tuple(p[0] for p in parts), tuple(p[1] for p in parts), tuple(p[2] for p in parts))


# Tokens at each end of a shard checked against vocab_size when it is opened (a wrong dtype or
# vocabulary shows there); the rest is never read up front.
_CHECKED_TOKENS = 4096


def _open_split(root: str, meta_path: str, name: str, files: Any, dtype: str, vocab: int,
                errors: list[str], sizes: dict[str, int] | None = None) -> TokenStream:
    """The split ``name``'s shards, mapped (on object storage, ``sizes`` {URI: bytes} from the
    prefix's listing); each problem is appended to ``errors`` (all of them)."""
    if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
        errors.append(f"{meta_path}: splits.{name} must list at least one shard file (paths relative to {root})")
        return TokenStream((), ())
    parts: list[tuple[np.ndarray, str, int]] = []
    itemsize = np.dtype(dtype).itemsize
    for rel in files:
        if sizes is not None:
            norm = os.path.normpath("/" + rel).lstrip("/")  # ".." cannot climb above the prefix
            path = objstore.join(root, norm)
            inside = norm == os.path.normpath(rel) and not rel.startswith("/")
        else:
            path = os.path.normpath(os.path.join(root, rel))
            inside = os.path.commonpath([root, path]) == root
        if not inside:
            errors.append(f"{meta_path}: shard {rel!r} lies outside the dataset directory: list paths inside it")
            continue
        if not path.endswith(SHARD_EXTENSIONS):
            errors.append(f"{meta_path}: shard {rel!r} is not a .bin or .npy file")
            continue
        try:
            if sizes is not None:
                arr = _remote_shard(path, sizes, dtype, itemsize, errors)
                if arr is None:
                    continue
            elif path.endswith(".npy"):
                arr = np.load(path, mmap_mode="r", allow_pickle=False)
                if arr.ndim != 1 or arr.dtype != np.dtype(dtype):
                    errors.append(f"shard {path} holds {arr.dtype} of shape {arr.shape}; meta.json says 1-D {dtype}")
                    continue
            else:
                size = os.path.getsize(path)
                if size % itemsize:
                    errors.append(f"shard {path} has {size:,} bytes, not a whole number of {dtype} tokens "
                                  f"({itemsize} bytes each): it is truncated, or meta.json's dtype is wrong")
                    continue
                if size == 0:
                    errors.append(f"shard {path} is empty: remove it from meta.json or remake the dataset")
                    continue
                arr = np.memmap(path, dtype=dtype, mode="r")
        except FileNotFoundError:
            errors.append(f"shard {path} listed in {meta_path} does not exist")
            continue
        except (OSError, ValueError) as exc:
            errors.append(f"shard {path} cannot be memory-mapped: {exc}")
            continue
        if len(arr) < 2:
            errors.append(f"shard {path} holds {len(arr)} token(s); a shard needs at least 2")
            continue
        offset = int(getattr(arr, "offset", 0))  # a .npy's header
        head = min(len(arr), _CHECKED_TOKENS)
        try:  # read, not through the map (see TokenStream.window)
            ends = max(int(_read(path, arr.dtype, offset, head).max()),
                       int(_read(path, arr.dtype, offset + (len(arr) - head) * itemsize, head).max()))
        except OSError as exc:
            errors.append(str(exc))
            continue
        if ends >= vocab:
            errors.append(f"shard {path} holds token id {ends:,}, not below vocab_size {vocab:,}: meta.json's "
                          "vocab_size or dtype does not match the shards")
            continue
        parts.append((arr, path, offset))
    return _stream(parts)


@dataclasses.dataclass(frozen=True)
class TokensInfo:
    """What :func:`inspect_tokens` read from a token dataset (for the dashboard)."""

    summary: str
    """One line, e.g. ``"12,345,678 tokens in 3 shards (train), 1,234 (val), vocab 8,192, uint16"``."""
    vocab_size: int
    dtype: str
    train_tokens: int
    val_tokens: int
    train_shards: int
    val_shards: int
    val_from_train: bool
    """True when the dataset has no val shards and the tail of train is held out."""


def inspect_tokens(uri: str, *, val_fraction: float = 0.2) -> TokensInfo:
    """Open the token dataset at ``uri`` as the trainer will (:func:`open_tokens`, a dataset without
    val shards holding out ``val_fraction`` of train) and summarise it; reads a few pages per shard.
    Raises :class:`ConfigError` as :func:`open_tokens`."""
    data = open_tokens(uri, val_fraction=val_fraction)
    held_out = data.meta["splits"].get("val") in (None, [])
    train_n, val_n = data.train.num_tokens, data.val.num_tokens
    shards = len(data.train.shards)
    val_text = (f"{val_n:,} (val: the last {val_fraction:.0%} of train, data.val_fraction)" if held_out
                else f"{val_n:,} (val)")
    summary = (f"{train_n:,} tokens in {shards:,} shard{'s' if shards != 1 else ''} (train), {val_text}, "
               f"vocab {data.vocab_size:,}, {data.dtype}")
    return TokensInfo(summary=summary, vocab_size=data.vocab_size, dtype=data.dtype, train_tokens=train_n,
                      val_tokens=val_n, train_shards=shards, val_shards=len(data.val.shards),
                      val_from_train=held_out)


# -- writing ---------------------------------------------------------------------------------------


def token_dtype(vocab_size: int) -> str:
    """The narrowest shard dtype for token ids 0 … vocab_size − 1: uint16 up to 65,536, else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


class ShardWriter:
    """Appends token ids to one split's ``.bin`` shards under ``<root>/<split>/``, starting a new
    shard every ``shard_tokens`` tokens; memory is one ``append`` call's ids, never a whole shard.

    ``files`` lists the shards written so far, relative to ``root`` (what ``meta.json`` lists).
    """

    def __init__(self, root: str, split: str, dtype: str, shard_tokens: int) -> None:
        if dtype not in TOKEN_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}")
        if shard_tokens < 2:
            raise ValueError(f"shard_tokens must be at least 2, got {shard_tokens}")
        self.root, self.split, self.dtype, self.shard_tokens = root, split, np.dtype(dtype), shard_tokens
        self.files: list[str] = []
        self.num_tokens = 0
        self._file = None
        self._in_shard = 0

    def append(self, ids: Any) -> None:
        """Append the token ids ``ids`` (a 1-D sequence of ints below the dtype's limit)."""
        arr = np.asarray(ids, dtype=self.dtype)
        while len(arr):
            if self._file is None or self._in_shard == self.shard_tokens:
                self._next_shard()
            take = arr[:self.shard_tokens - self._in_shard]
            take.tofile(self._file)
            self._in_shard += len(take)
            self.num_tokens += len(take)
            arr = arr[len(take):]

    def _next_shard(self) -> None:
        self._close_file()
        rel = f"{self.split}/{len(self.files):06d}.bin"
        os.makedirs(os.path.join(self.root, self.split), exist_ok=True)
        self._file = open(os.path.join(self.root, rel), "wb")
        self.files.append(rel)
        self._in_shard = 0

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self) -> list[str]:
        """Close the last shard; returns :attr:`files`."""
        self._close_file()
        return self.files


def write_meta(root: str, *, dtype: str, vocab_size: int, splits: dict[str, list[str]], tokenizer: str = "",
               **extra: Any) -> str:
    """Write ``<root>/meta.json`` (atomically: a reader never sees half of it) for shards already
    written; ``extra`` keys (e.g. ``"source"``) are stored beside the required ones. Returns its path."""
    meta = {"format": META_FORMAT, "version": 1, "dtype": dtype, "vocab_size": int(vocab_size),
            "tokenizer": tokenizer, "splits": splits, **extra}
    path = os.path.join(root, META_NAME)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


def write_tokens(root: str, *, vocab_size: int, train: list[Any], val: list[Any], dtype: str = "",
                 tokenizer: str = "") -> str:
    """A token dataset at ``root`` from in-memory arrays: one shard per array of ``train`` and
    ``val`` (each 1-D token ids), of ``dtype`` (default :func:`token_dtype`). For tests and small
    data; :mod:`trainer_pkg.prepare_text` streams text instead. Returns ``root``."""
    dtype = dtype or token_dtype(vocab_size)
    os.makedirs(root, exist_ok=True)
    splits = {}
    for name, arrays in (("train", train), ("val", val)):
        splits[name] = []
        for i, ids in enumerate(arrays):
            rel = f"{name}/{i:06d}.bin"
            os.makedirs(os.path.join(root, name), exist_ok=True)
            np.asarray(ids, dtype=dtype).tofile(os.path.join(root, rel))
            splits[name].append(rel)
    write_meta(root, dtype=dtype, vocab_size=vocab_size, splits=splits, tokenizer=tokenizer)
    return root
