"""Turn raw text files into a token dataset (:mod:`trainer_pkg.tokens`): train a byte-level BPE
tokenizer locally, then encode the text into ``.bin`` shards, streaming.

    python -m trainer_pkg.prepare_text book1.txt book2.txt --out data/books --vocab-size 8192
    python -m trainer_pkg.prepare_text corpus/ --out data/more --tokenizer data/books/tokenizer.json

Each INPUT is a UTF-8 text file, or a folder whose files (every file below it, sorted by path) are
read. The first ``1 − val_fraction`` of each file's bytes (cut at a line end) goes to the train
split, the rest to the val split, so validation text is never next to training text inside a line.
Files are separated by the ``<|endoftext|>`` token.

The tokenizer is the ``tokenizers`` library's BPE over bytes (ByteLevel pre-tokenizer: any text
encodes, no unknown token), trained on the train part of the inputs, saved as ``<out>/tokenizer.json``
(or ``--tokenizer FILE``: an existing one, copied there, no training). Text is read in batches of
lines and encoded a batch at a time, so memory holds one batch and the tokenizer's pair counts, never
the corpus. Shards are uint16 when the vocabulary has at most 65,536 tokens, else uint32; a new shard
starts every ``--shard-tokens`` tokens. Nothing is downloaded.

Progress goes to stderr; a summary line (JSON) to stdout. Every error in the arguments is reported
at once, and the exit status is then 2. Torch-free; needs ``pip install 'trainboard-trainer[text]'``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from typing import Callable, Iterator, Sequence

from trainer_pkg.tokens import ShardWriter, token_dtype, write_meta

END_OF_TEXT = "<|endoftext|>"
# Byte-level BPE starts from the 256 byte symbols plus the end-of-text token.
MIN_VOCAB = 257
MAX_VOCAB = 1 << 32
# Lines joined into one string per encode call, and strings per encode_batch call: a few MB at a time.
_LINES_PER_CHUNK = 64
_CHUNKS_PER_BATCH = 256


class PrepareError(ValueError):
    """The inputs or options cannot make a token dataset; ``errors`` lists every problem found."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What :func:`prepare_text` wrote."""

    out: str
    """The dataset directory (holding meta.json, tokenizer.json, train/ and val/)."""
    vocab_size: int
    dtype: str
    train_tokens: int
    val_tokens: int
    train_shards: int
    val_shards: int
    files: int
    """Input text files read."""
    text_bytes: int
    """Their total size in bytes."""
    seconds: float

    def summary(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _input_files(inputs: Sequence[str], errors: list[str]) -> list[str]:
    files: list[str] = []
    for given in inputs:
        path = os.path.expanduser(given)
        if os.path.isdir(path):
            found = sorted(os.path.join(d, name) for d, _, names in os.walk(path) for name in names
                           if not name.startswith("."))
            if not found:
                errors.append(f"input folder {given} holds no files")
            files += found
        elif os.path.isfile(path):
            files.append(path)
        else:
            errors.append(f"input {given} does not exist: give text files or folders of them")
    for path in files:
        if not os.access(path, os.R_OK):
            errors.append(f"input {path} is not readable by this process: fix its permissions")
    if files and all(os.path.isfile(p) and os.path.getsize(p) == 0 for p in files):
        errors.append("every input file is empty: there is no text to tokenize")
    return files


def check_options(inputs: Sequence[str], out: str, *, vocab_size: int | None, val_fraction: float,
                  shard_tokens: int, tokenizer: str = "") -> tuple[list[str], list[str]]:
    """(input files, every problem found): the inputs exist and are readable, ``out`` is a new or
    empty folder, ``vocab_size``, ``val_fraction`` and ``shard_tokens`` are in range, and an existing
    ``tokenizer`` file loads. Each problem names the option and what to do."""
    errors: list[str] = []
    if not inputs:
        errors.append("INPUT: give at least one text file or folder")
    files = _input_files(inputs, errors)
    if not out:
        errors.append("--out: give the folder to write the dataset to")
    elif os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        what = "a file" if not os.path.isdir(out) else "a folder that is not empty"
        errors.append(f"--out {out} is {what}: give a new or empty folder (an existing dataset is never overwritten)")
    if vocab_size is not None and not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        errors.append(f"--vocab-size must be from {MIN_VOCAB} (the 256 bytes and {END_OF_TEXT}) to "
                      f"{MAX_VOCAB:,}, got {vocab_size:,}")
    if not 0 < val_fraction < 1:
        errors.append(f"--val-fraction must be above 0 and below 1 (a dataset needs a val split), got {val_fraction:g}")
    if shard_tokens < 2:
        errors.append(f"--shard-tokens must be at least 2, got {shard_tokens:,}")
    if tokenizer:
        try:
            tok = load_tokenizer(tokenizer)
        except (PrepareError, OSError, ValueError, RuntimeError) as exc:
            errors.append(f"--tokenizer {tokenizer}: {exc}")
        else:
            if vocab_size is not None and vocab_size != tok.get_vocab_size():
                errors.append(f"--vocab-size {vocab_size:,} differs from --tokenizer {tokenizer}'s "
                              f"{tok.get_vocab_size():,} tokens: leave --vocab-size out with an existing tokenizer")
    return files, errors


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise PrepareError(["prepare_text needs the tokenizers library: pip install 'trainboard-trainer[text]'"]) from None
    return tokenizers


def load_tokenizer(path: str):
    """The ``tokenizers.Tokenizer`` saved at ``path`` (a tokenizer.json). Raises ValueError saying
    what is wrong with the file (missing, unreadable, not a tokenizer)."""
    tk = _tokenizers()
    if not os.path.isfile(path):
        raise ValueError("no such file: give the tokenizer.json of an earlier prepare_text (in its --out)")
    try:
        return tk.Tokenizer.from_file(path)
    except Exception as exc:  # the Rust library raises a bare Exception for every kind of bad file
        raise ValueError(f"not a tokenizers tokenizer.json ({str(exc).splitlines()[0][:200]})") from None


def _lines(path: str, split: str, val_fraction: float) -> Iterator[str]:
    """The lines (each with its newline) of ``path``'s ``split``: train is the file's first
    ``1 − val_fraction`` of bytes, up to the line end after that point; val the rest."""
    cut = os.path.getsize(path) * (1 - val_fraction)
    offset = 0
    with open(path, "rb") as f:
        for raw in f:
            in_train = offset < cut
            offset += len(raw)
            if in_train == (split == "train"):
                try:
                    yield raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise PrepareError([f"input {path} is not UTF-8 text (byte {offset - len(raw) + exc.start:,}): "
                                        "convert it to UTF-8 or leave it out"]) from None
            elif split == "train":
                return


def _chunks(lines: Iterator[str]) -> Iterator[list[str]]:
    """Batches of strings (each ``_LINES_PER_CHUNK`` lines joined) for ``encode_batch``."""
    batch, chunk = [], []
    for line in lines:
        chunk.append(line)
        if len(chunk) == _LINES_PER_CHUNK:
            batch.append("".join(chunk))
            chunk = []
            if len(batch) == _CHUNKS_PER_BATCH:
                yield batch
                batch = []
    if chunk:
        batch.append("".join(chunk))
    if batch:
        yield batch


def train_tokenizer(files: Sequence[str], vocab_size: int, val_fraction: float):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` tokens (``<|endoftext|>`` is
    id 0) trained on the train part of ``files``, read a batch of lines at a time."""
    tk = _tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    texts = (chunk for path in files for batch in _chunks(_lines(path, "train", val_fraction)) for chunk in batch)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def prepare_text(inputs: Sequence[str], out: str, *, vocab_size: int | None = None, val_fraction: float = 0.01,
                 shard_tokens: int = 100_000_000, tokenizer: str = "",
                 progress: Callable[[str], None] | None = None) -> Prepared:
    """Make the token dataset ``out`` from the text ``inputs`` (see the module's docstring);
    ``vocab_size`` None means 8,192 for a new tokenizer, or the existing ``tokenizer``'s.

    Raises :class:`PrepareError` listing every problem with the options (:func:`check_options`), or
    naming an input that is not UTF-8. A dataset left half-written by an error is removed.
    """
    say = progress or (lambda msg: None)
    files, errors = check_options(inputs, out, vocab_size=vocab_size, val_fraction=val_fraction,
                                  shard_tokens=shard_tokens, tokenizer=tokenizer)
    if errors:
        raise PrepareError(errors)
    tick = time.perf_counter()
    text_bytes = sum(os.path.getsize(p) for p in files)
    os.makedirs(out, exist_ok=True)
    try:
        if tokenizer:
            tok = load_tokenizer(tokenizer)
            say(f"tokenizer {tokenizer}: {tok.get_vocab_size():,} tokens")
        else:
            say(f"training a byte-level BPE tokenizer of {vocab_size or 8192:,} tokens on {len(files):,} "
                f"file(s), {text_bytes / 1e6:,.1f} MB")
            tok = train_tokenizer(files, vocab_size or 8192, val_fraction)
        tok.save(os.path.join(out, "tokenizer.json"))
        vocab = tok.get_vocab_size()
        eot = tok.token_to_id(END_OF_TEXT)
        dtype = token_dtype(vocab)
        writers = {split: ShardWriter(out, split, dtype, shard_tokens) for split in ("train", "val")}
        for i, path in enumerate(files):
            for split, writer in writers.items():
                before = writer.num_tokens
                for batch in _chunks(_lines(path, split, val_fraction)):
                    for enc in tok.encode_batch_fast(batch, add_special_tokens=False):
                        writer.append(enc.ids)
                if eot is not None and writer.num_tokens > before:
                    writer.append([eot])
            seconds = time.perf_counter() - tick
            say(f"encoded {i + 1:,}/{len(files):,} file(s): {writers['train'].num_tokens:,} train and "
                f"{writers['val'].num_tokens:,} val tokens ({seconds:,.1f} s)")
        splits = {split: w.close() for split, w in writers.items()}
        for split, w in writers.items():
            if w.num_tokens < 2:
                raise PrepareError([f"the {split} split got {w.num_tokens} token(s): give more text or change "
                                    f"--val-fraction ({val_fraction:g})"])
        write_meta(out, dtype=dtype, vocab_size=vocab, splits=splits, tokenizer="tokenizer.json",
                   end_of_text=eot, source={"files": [os.path.abspath(p) for p in files], "bytes": text_bytes,
                                            "val_fraction": val_fraction},
                   num_tokens={split: w.num_tokens for split, w in writers.items()})
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return Prepared(out=os.path.abspath(out), vocab_size=vocab, dtype=dtype,
                    train_tokens=writers["train"].num_tokens, val_tokens=writers["val"].num_tokens,
                    train_shards=len(splits["train"]), val_shards=len(splits["val"]), files=len(files),
                    text_bytes=text_bytes, seconds=time.perf_counter() - tick)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options (shared with ``manage.py prepare_text``)."""
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="UTF-8 text files, or folders whose files are all read (sorted by path)")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="new or empty folder for the dataset: meta.json, tokenizer.json, train/, val/")
    parser.add_argument("--vocab-size", type=int, default=None, metavar="N",
                        help=f"tokens in the BPE vocabulary to train, {MIN_VOCAB} to {MAX_VOCAB:,} "
                             "(default 8192; with --tokenizer: that tokenizer's)")
    parser.add_argument("--val-fraction", type=float, default=0.01, metavar="F",
                        help="share of each file (its tail, cut at a line end) kept for validation (default 0.01)")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000, metavar="N",
                        help="tokens per shard file before a new one starts (default 100,000,000)")
    parser.add_argument("--tokenizer", default="", metavar="FILE",
                        help="an existing tokenizer.json to encode with instead of training one")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer_pkg.prepare_text",
        description="Turn text files into a Trainboard token dataset (data.format tokens): train a "
                    "byte-level BPE tokenizer locally, encode the text into uint16/uint32 shards.",
        epilog="Example: python -m trainer_pkg.prepare_text books/ --out data/books --vocab-size 8192")
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        done = prepare_text(args.inputs, args.out, vocab_size=args.vocab_size, val_fraction=args.val_fraction,
                            shard_tokens=args.shard_tokens, tokenizer=args.tokenizer,
                            progress=lambda msg: print(f"[prepare_text] {msg}", file=sys.stderr, flush=True))
    except PrepareError as exc:
        for error in exc.errors:
            print(f"prepare_text: error: {error}", file=sys.stderr)
        return 2
    print(f"[prepare_text] wrote {done.out}: {done.train_tokens:,} train tokens in {done.train_shards} shard(s), "
          f"{done.val_tokens:,} val tokens, vocab {done.vocab_size:,}, {done.dtype} ({done.seconds:,.1f} s)",
          file=sys.stderr)
    print(json.dumps(done.summary()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
