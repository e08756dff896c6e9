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
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

from trainer_pkg.config import ConfigError

META_NAME = "meta.json"
META_FORMAT = "trainboard-tokens"
TOKEN_DTYPES = ("uint16", "uint32")
SHARD_EXTENSIONS = (".bin", ".npy")


@dataclasses.dataclass(frozen=True)
class TokenStream:
    """One split: its shards in order, each a 1-D memory-mapped array of token ids."""

    shards: tuple[np.ndarray, ...]
    """(tokens,) uint16/uint32 memmaps, one per file; never copied whole."""
    paths: tuple[str, ...]
    """The shard files, absolute, in the same order."""

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.shards)

    def window(self, shard: int, start: int, length: int) -> np.ndarray:
        """Tokens ``start … start + length − 1`` of shard ``shard`` as a new int64 array (length,).
        Raises IndexError when the window runs past the shard's end."""
        s = self.shards[shard]
        if start < 0 or start + length > len(s):
            raise IndexError(f"window {start}+{length} outside shard {self.paths[shard]} of {len(s)} tokens")
        return np.asarray(s[start:start + length], dtype=np.int64)


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


def open_tokens(uri: str) -> TokenDataset:
    """Open the token dataset at the local directory ``uri`` (its ``meta.json`` and shards).

    Raises :class:`ConfigError` naming the file and what to do when the directory, its ``meta.json``
    or a shard is missing or malformed, when the dtype is not uint16/uint32, or when a split is empty.
    """
    root = os.path.abspath(os.path.expanduser(uri[len("file://"):] if uri.startswith("file://") else uri))
    meta_path = os.path.join(root, META_NAME)
    if not os.path.isdir(root):
        raise ConfigError(f"tokens dataset {root} is not a directory: give the folder holding {META_NAME} "
                          "(made by prepare_text)")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"tokens dataset {root} has no {META_NAME}: make it with prepare_text") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{meta_path} cannot be read as JSON: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT:
        raise ConfigError(f"{meta_path} is not a Trainboard token dataset (format {META_FORMAT!r})")
    dtype, vocab = meta.get("dtype"), meta.get("vocab_size")
    if dtype not in TOKEN_DTYPES:
        raise ConfigError(f"{meta_path}: dtype must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not 2 <= vocab <= np.iinfo(dtype).max + 1:
        raise ConfigError(f"{meta_path}: vocab_size must be an integer from 2 to {np.iinfo(dtype).max + 1:,} "
                          f"for {dtype} tokens, got {vocab!r}")
    splits = meta.get("splits") or {}
    streams = {name: _open_split(root, meta_path, name, splits.get(name), dtype) for name in ("train", "val")}
    tokenizer = meta.get("tokenizer") or ""
    return TokenDataset(root=root, vocab_size=vocab, dtype=dtype, train=streams["train"], val=streams["val"],
                        tokenizer=os.path.join(root, tokenizer) if tokenizer else "", meta=meta)


def _open_split(root: str, meta_path: str, name: str, files: Any, dtype: str) -> TokenStream:
    if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
        raise ConfigError(f"{meta_path}: splits.{name} must list at least one shard file")
    shards, paths = [], []
    for rel in files:
        path = os.path.normpath(os.path.join(root, rel))
        if os.path.commonpath([root, path]) != root:
            raise ConfigError(f"{meta_path}: shard {rel!r} lies outside the dataset directory")
        if not path.endswith(SHARD_EXTENSIONS):
            raise ConfigError(f"{meta_path}: shard {rel!r} is not a .bin or .npy file")
        try:
            if path.endswith(".npy"):
                arr = np.load(path, mmap_mode="r", allow_pickle=False)
                if arr.ndim != 1 or arr.dtype != np.dtype(dtype):
                    raise ConfigError(f"shard {path} holds {arr.dtype} of shape {arr.shape}; expected 1-D {dtype}")
            else:
                arr = np.memmap(path, dtype=dtype, mode="r")
        except FileNotFoundError:
            raise ConfigError(f"shard {path} listed in {meta_path} does not exist") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"shard {path} cannot be memory-mapped: {exc}") from None
        if len(arr) < 2:
            raise ConfigError(f"shard {path} holds {len(arr)} token(s); a shard needs at least 2")
        shards.append(arr)
        paths.append(path)
    return TokenStream(tuple(shards), tuple(paths))


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
