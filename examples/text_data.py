"""Text for the sequence examples: the Python standard library's own source.

Every Python installation ships it, so nothing is downloaded. The corpus is
the top-level .py files of `sysconfig.get_paths()["stdlib"]` (about 170
files, 4.7 MB on CPython 3.11), sorted by name so that the list is fixed for
an installation; the vocabulary is the 256 byte values.

Split: every tenth file (by sorted index) is validation, the rest train, so
that no file is in both.

Batches draw excerpts: a random file, a random start, a random length.
  ragged (the LSTM LM):  one excerpt a row, padded to `steps`:
    tokens [B, T], targets [B, T] (the next byte), seq_lengths [B];
    steps t >= seq_lengths[b] are padding (zeros) and carry no loss.
  packed (the Transformer): several excerpts a row, each its own segment:
    tokens [B, T], targets [B, T], segment_ids [B, T] (1, 2, ... in a row;
    0 for padding), positions [B, T] (0 at each segment's start),
    weights [B, T] (1.0 where the target is the next byte of the same
    segment; 0.0 at a segment's last byte and at padding).
Random bytes in place of the files give make_step's well-formed random
batches through the same code (`random_documents`).
"""

from __future__ import annotations

import functools
import pathlib
import sysconfig

import numpy as np

VOCAB = 256


def stdlib_files() -> list[pathlib.Path]:
  """The corpus: the standard library's top-level .py files, sorted by name."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = sorted(root.glob("*.py"))
  if not files:
    raise FileNotFoundError(f"no .py files in the standard library directory {root}")
  return files


@functools.lru_cache(maxsize=2)
def documents(split: str = "train") -> tuple[np.ndarray, ...]:
  """The files of one split ("train" or "validation") as uint8 arrays."""
  if split not in ("train", "validation"):
    raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
  files = stdlib_files()
  keep = [f for i, f in enumerate(files) if (i % 10 == 9) == (split == "validation")]
  # Files too short to give a two-byte excerpt carry nothing to learn.
  docs = tuple(np.frombuffer(f.read_bytes(), np.uint8) for f in keep)
  return tuple(d for d in docs if d.size >= 2)


def random_documents(rng: np.random.Generator, count: int = 64,
                     length: int = 4096) -> tuple[np.ndarray, ...]:
  """Random bytes shaped like the corpus, for make_step's synthetic batches."""
  return tuple(rng.integers(0, VOCAB, size=length, dtype=np.uint8) for _ in range(count))


def _excerpt(rng, docs, length):
  """length + 1 bytes (or fewer, where the file is shorter) from a random place."""
  doc = docs[rng.integers(len(docs))]
  length = min(length, doc.size - 1)
  start = rng.integers(doc.size - length)
  return doc[start:start + length + 1]


def ragged_batch(rng: np.random.Generator, docs, batch: int, steps: int,
                 min_length: int | None = None) -> dict[str, np.ndarray]:
  """One excerpt a row, lengths uniform in [min_length, steps] (default steps // 4)."""
  min_length = max(1, steps // 4) if min_length is None else min_length
  tokens = np.zeros((batch, steps), np.int32)
  targets = np.zeros((batch, steps), np.int32)
  lengths = np.zeros((batch,), np.int32)
  for b in range(batch):
    piece = _excerpt(rng, docs, int(rng.integers(min_length, steps + 1)))
    n = piece.size - 1
    tokens[b, :n], targets[b, :n], lengths[b] = piece[:-1], piece[1:], n
  return {"tokens": tokens, "targets": targets, "seq_lengths": lengths}


def packed_batch(rng: np.random.Generator, docs, batch: int, seq_len: int,
                 min_length: int | None = None) -> dict[str, np.ndarray]:
  """Rows filled with excerpts of lengths uniform in [min_length, seq_len]
  (default seq_len // 8), each its own segment; a row's tail shorter than
  min_length stays padding."""
  min_length = max(2, seq_len // 8) if min_length is None else min_length
  tokens = np.zeros((batch, seq_len), np.int32)
  targets = np.zeros((batch, seq_len), np.int32)
  segment_ids = np.zeros((batch, seq_len), np.int32)
  positions = np.zeros((batch, seq_len), np.int32)
  weights = np.zeros((batch, seq_len), np.float32)
  for b in range(batch):
    t, segment = 0, 1
    while seq_len - t >= min_length:
      length = int(rng.integers(min_length, seq_len - t + 1))
      piece = _excerpt(rng, docs, length - 1)  # up to `length` bytes of one file
      n = piece.size
      tokens[b, t:t + n] = piece
      targets[b, t:t + n - 1] = piece[1:]
      weights[b, t:t + n - 1] = 1.0  # the segment's last byte has no next byte in it
      segment_ids[b, t:t + n] = segment
      positions[b, t:t + n] = np.arange(n)
      t, segment = t + n, segment + 1
  return {"tokens": tokens, "targets": targets, "segment_ids": segment_ids,
          "positions": positions, "weights": weights}


def stream(make_batch, docs, batch: int, length: int, seed: int):
  """Endless batches of make_batch (ragged_batch or packed_batch) from docs."""
  rng = np.random.default_rng(seed)
  while True:
    yield make_batch(rng, docs, batch, length)
