"""Helpers the ops' batching rules share.

vmap never loops over a jax_dnn kernel: each batching rule folds the mapped
axis into a dimension the kernel already has (rows, the attention batch, the
parameter param_sets G of a [G, W] parameter) and splits it back out of the
results. These helpers move, fold and split that axis; under explicit mesh
axes the reshapes keep the operands' shardings in their types.
"""

from __future__ import annotations

import jax
import numpy as np

from jax_dnn._src import sharding as sharding_lib

# The batch dimension of an operand that vmap did not batch.
NOT_MAPPED = None


def batch_size(args, dims) -> int:
  """The size of the mapped axis (from the first batched argument)."""
  for x, d in zip(args, dims):
    if d is not NOT_MAPPED:
      return x.shape[d]
  raise ValueError("batching rule called with no batched argument")


def move_to_front(x, bdim, size):
  """Returns x with its batch axis first, broadcasting an unbatched x."""
  if bdim is NOT_MAPPED:
    return jax.numpy.broadcast_to(x, (size,) + x.shape)
  return jax.numpy.moveaxis(x, bdim, 0)


def merge_leading(x):
  """[m, n, ...] -> [m * n, ...]: vmap's axis folded into a batch as its
  major part. Under explicit mesh axes the merged dimension is split by m's
  mesh axes then n's; a split of n alone (no contiguous split of the merged
  dimension) is gathered first."""
  shape = (x.shape[0] * x.shape[1],) + tuple(x.shape[2:])
  spec = sharding_lib.explicit_spec(x)
  if spec is None:
    return x.reshape(shape)
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  if spec[0] is None and spec[1] is not None and x.shape[0] > 1:
    x, spec = jax.sharding.reshard(x, P(None, None, *spec[2:])), (None, None) + spec[2:]
  names = sharding_lib.axis_names(spec[0]) + sharding_lib.axis_names(spec[1])
  merged = sharding_lib.spec_entry(names)
  return jax.lax.reshape(x, shape, out_sharding=P(merged, *spec[2:]))


def split_leading(x, size):
  """[size * n, ...] -> [size, n, ...], the inverse of merge_leading. Under
  explicit mesh axes the mesh axes splitting the merged dimension go to
  `size` as far as they divide it, the rest to n (gathered where they do
  not divide it)."""
  shape = (size, x.shape[0] // size) + tuple(x.shape[1:])
  spec = sharding_lib.explicit_spec(x)
  if spec is None:
    return x.reshape(shape)
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  mesh = jax.typeof(x).sharding.mesh
  names = sharding_lib.axis_names(spec[0])
  k = 0
  while k < len(names) and size % int(np.prod([mesh.shape[a] for a in names[:k + 1]])) == 0:
    k += 1
  if shape[1] % int(np.prod([mesh.shape[a] for a in names[k:]])):
    x, names = jax.sharding.reshard(x, P(None, *spec[1:])), ()
  return jax.lax.reshape(x, shape, out_sharding=P(sharding_lib.spec_entry(names[:k]),
                                                  sharding_lib.spec_entry(names[k:]), *spec[1:]))


def fold_param_sets(params, bdim, size, *, shared_ok: bool):
  """Folds a vmapped axis into the param_set axis of a [param_sets, width] parameter.

  Row r of the kernel's input uses parameter set r // (rows / param_sets), and
  the batching rules put the vmapped axis of the input first, so the batched
  parameter becomes [size * param_sets, width] (broadcast when unbatched).
  With shared_ok (forward rules), an unbatched single-param_set parameter is left
  alone, since every row uses it anyway. Backward rules must fold: each batch
  element needs its own parameter gradient (vmap of grad is per example).
  """
  if bdim is NOT_MAPPED and shared_ok and params.shape[0] == 1:
    return params
  return merge_leading(move_to_front(params, bdim, size))
