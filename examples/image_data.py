"""Images for the image examples (train_cnn.py, train_unet.py), offline.

scikit-learn's handwritten digits (`sklearn.datasets.load_digits`: 1,797 8x8
grey images, 16 levels, 10 classes; the data ships inside the package) are
split once into 1,438 training and 359 test images (a fixed permutation),
upscaled bilinearly to size x size, repeated to 3 channels and mapped to
[-1, 1]. Layout NHWC float32, as Flax's convolutions take it.

The 8x8 originals stay in memory and each batch is upscaled as it is drawn
(two small matrix products, matching jax.image.resize's bilinear), so a
224^2 run holds no 1 GB upscaled copy: on the host (train_batches, numpy) or
on the device (device_batches, what the training loops use).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

NUM_CLASSES = 10
_TEST_FRACTION = 0.2
_SPLIT_SEED = 0  # the split is part of the data set: fixed, whatever the run's seed


@functools.lru_cache(maxsize=1)
def _digits():
  """(images [N, 8, 8] float32 in [0, 1], labels [N] int32), train/test split."""
  from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float32)
  labels = digits.target.astype(np.int32)
  order = np.random.default_rng(_SPLIT_SEED).permutation(len(labels))
  n_test = int(round(_TEST_FRACTION * len(labels)))
  test, train = order[:n_test], order[n_test:]
  return (images[train], labels[train]), (images[test], labels[test])


@functools.lru_cache(maxsize=8)
def _resize_matrix(size: int, source: int = 8) -> np.ndarray:
  """[size, source] bilinear interpolation weights, pixel centres aligned
  (half-pixel offsets, as jax.image.resize's 'bilinear'), edges clamped."""
  centres = (np.arange(size) + 0.5) * source / size - 0.5
  lo = np.clip(np.floor(centres).astype(int), 0, source - 1)
  hi = np.clip(lo + 1, 0, source - 1)
  frac = np.clip(centres - lo, 0.0, 1.0)
  weights = np.zeros((size, source), np.float32)
  weights[np.arange(size), lo] += 1.0 - frac
  weights[np.arange(size), hi] += frac
  return weights


def _upscale(xp, images, size: int, channels: int, **einsum_options):
  """upscale's math in numpy or jax.numpy (xp)."""
  w = xp.asarray(_resize_matrix(size))
  big = 2.0 * xp.einsum("ij,njk,lk->nil", w, images, w, **einsum_options) - 1.0
  return xp.repeat(big[..., None], channels, axis=-1).astype(np.float32)


def upscale(images: np.ndarray, size: int, channels: int = 3) -> np.ndarray:
  """[N, 8, 8] in [0, 1] -> [N, size, size, channels] float32 in [-1, 1]."""
  return _upscale(np, images, size, channels, optimize=True)


def num_examples(split: str = "train") -> int:
  train, test = _digits()
  return len((train if split == "train" else test)[1])


def test_set(size: int, channels: int = 3) -> tuple[np.ndarray, np.ndarray]:
  """The whole test split: (images [359, size, size, channels], labels [359])."""
  _, (images, labels) = _digits()
  return upscale(images, size, channels), labels


def _train_indices(batch: int, seed: int):
  """Endless [batch] index arrays into the training split: consecutive chunks
  of a stream of epochs, each a permutation drawn from (seed, epoch)."""
  if batch < 1:
    raise ValueError(f"batch must be positive, got {batch}")
  count = num_examples("train")
  pending, epoch = np.zeros((0,), np.int64), 0
  while True:
    while len(pending) < batch:
      order = np.random.default_rng((seed, epoch)).permutation(count)
      pending, epoch = np.concatenate([pending, order]), epoch + 1
    idx, pending = pending[:batch], pending[batch:]
    yield idx


def train_batches(batch: int, size: int, *, seed: int = 0, channels: int = 3):
  """Endless iterator of {"image": [batch, size, size, channels] float32 in
  [-1, 1], "label": [batch] int32} over the training split. Batches are
  consecutive chunks of a stream of epochs, each a permutation drawn from
  (seed, epoch), so a run is reproducible, every batch has one shape (one
  compiled step) and a batch may be larger than the split."""
  (images, labels), _ = _digits()
  for idx in _train_indices(batch, seed):
    yield {"image": upscale(images[idx], size, channels), "label": labels[idx]}


_upscale_on_device = jax.jit(
    functools.partial(_upscale, jnp, precision=jax.lax.Precision.HIGHEST),
    static_argnums=(1, 2))


def device_batches(batch: int, size: int, *, seed: int = 0, channels: int = 3,
                   sharding=None):
  """train_batches' batches as device arrays, upscaled on the device: only the
  8x8 originals cross the host link and the host does no per-pixel work (a
  batch of 256 at 224^2 is 154 MB of float32, which numpy took ~0.2-0.7 s to
  make, several times a ResNet-50 step). `sharding`: where the batch goes
  (e.g. split over a mesh's data axis; default: the default device). Equal to
  train_batches' within float32 rounding."""
  (images, labels), _ = _digits()
  for idx in _train_indices(batch, seed):
    small, label = jax.device_put((images[idx], labels[idx]), sharding)
    image = _upscale_on_device(small, size, channels)
    yield {"image": jax.device_put(image, sharding), "label": label}
