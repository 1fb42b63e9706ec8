"""The table of ops that the cross-cutting tests iterate.

One `OpCase` per public op says what those tests need to know about it: how
to build small random arguments (never zeros) for a dtype, which arguments
are differentiable, an independent reference of the same signature, the FFI
targets of its CUDA lowering, which dimensions may be split over devices,
and whether it has a second-order rule. The tests that read it:
  test_transforms.py    jit, vmap (each argument axis, nested), grad,
                        vmap(grad), check_grads; the CUDA lowering
  test_sharding.py      split operands, shard_map, explicit mesh axes
  test_export.py        jax.export (CUDA targets, a symbolic batch)
  test_higher_order.py  grad of grad, check_grads of order 2
  scripts/sanitize_ops.py  compute-sanitizer over every kernel
A new op adds one entry to CASES (and its own tests/test_<op>.py for
numerics over shapes and dtypes, options and bad inputs).

Sharding specs name the axes of the tests' mesh, ("data", "model"); shapes
here divide by 4 where "data" splits and by 2 where "model" does.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
from typing import Any

from flax.linen import pooling as flax_pooling
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

import jax_dnn


def randn(key, shape, dtype, scale=1.0, offset=0.0):
  """Random normal data (never zeros), rounded to dtype. From NumPy: no
  compilation for each new shape, as jax.random would need."""
  x = offset + scale * np.random.default_rng(key).standard_normal(shape, np.float32)
  return jnp.asarray(x.astype(jnp.dtype(dtype)))


@dataclasses.dataclass(frozen=True)
class Arg:
  """One array argument of an op.

  shape: its shape as a function of the leading argument's shape.
  dtype: None for the case's dtype, else this one whatever the case's.
  scale, offset: of its random normal values.
  differentiable: whether grad is taken with respect to it.
  split: the PartitionSpec entries under which the op runs on each shard
    with no gather.
  whole: the dimensions the op needs whole (split, they are gathered).
  batch: the dimension that follows a symbolic batch size in jax.export
    (None: fixed).
  """
  shape: Callable[[tuple[int, ...]], tuple[int, ...]] = lambda s: s
  dtype: Any = None
  scale: float = 1.0
  offset: float = 0.0
  differentiable: bool = True
  split: tuple = ()
  whole: tuple[int, ...] = ()
  batch: int | None = 0


@dataclasses.dataclass(frozen=True)
class OpCase:
  """A public op as the cross-cutting tests see it.

  fn: the op, positional array arguments only (static options bound).
  reference: an independent plain-JAX function of the same signature (JAX's
    own where it has one).
  shape: the leading argument's shape in the small cases.
  args: the array arguments, in order.
  targets: the FFI targets its CUDA lowering calls for the kernel dtype's
    arguments: the forward's, then the backward's (one or more).
  kernel_dtype: a dtype whose CUDA lowering takes the kernels.
  tol: rtol = atol of fp32 comparisons against the reference.
  rows: the leading argument is [rows..., width] and `shape` may be any
    such shape (the sanitizer's sweep of widths).
  second_order: grad of grad is defined (each primitive's JVP).
  check_grads: numerical differences hold (False at kinks such as relu's).
  check_shape: the leading argument's shape for check_grads (None: `shape`).
  check_eps: check_grads' finite-difference step. Its default, 1e-4, divides
    fp32's rounding of values ~10 (~1e-6) into an error of ~1e-2 an element,
    the tolerance itself; at 1e-3 the kernels' few-ulp differences from XLA
    stay well inside it, as does the central difference's error (~eps^2).
    Smaller where a step of 1e-3 crosses a kink (max pooling: two entries
    of a window that close swap).
  out_split: the result's PartitionSpec when the arguments are split as
    `Arg.split` says (None: as the leading argument's).
  vmap_keeps_batch_split: under vmap, a split of the leading argument's
    dimension 0 carries over to the result; False where the batching rule
    folds the vmapped axis into that dimension as its major part (the inner
    split is then no contiguous split of the folded one, and is gathered).
  lowering_here: test_transforms checks its small case's CUDA lowering; False
    where the kernels' plans decline such cases and the op's own test lowers
    shapes they take (the convolutions: channels not a multiple of 8, groups,
    strided dgrad, wgrads with fewer output tiles than SMs; max pooling,
    whose forward alone runs XLA's reduce_window by default).
  symbolic_batch: under jax.export's symbolic batch the CUDA lowering still
    calls the kernels; False where the plan needs the batch (the
    recurrence: its workspace and its by-default choice depend on it), and
    the reference runs.
  vmap_all_kernels: vmapping every argument still lowers to the kernels;
    False where per-instance weights run the reference (the recurrence:
    one set of weights a launch), whose vmapped lowering is then checked
    with the leading argument alone mapped.
  """
  name: str
  fn: Callable
  reference: Callable
  shape: tuple[int, ...]
  args: tuple[Arg, ...]
  targets: tuple[str, ...]
  kernel_dtype: Any = jnp.bfloat16
  tol: float = 2e-5
  rows: bool = True
  second_order: bool = True
  check_grads: bool = True
  check_shape: tuple[int, ...] | None = None
  check_eps: float = 1e-3
  out_split: tuple | None = None
  vmap_keeps_batch_split: bool = True
  vmap_split_gathers: bool = True
  vmap_out_split: tuple | None = None
  lowering_here: bool = True
  symbolic_batch: bool = True
  vmap_all_kernels: bool = True

  def make_args(self, dtype=jnp.float32, *, key=0, shape=None):
    """Random arguments for `dtype`, the leading one of `shape` (default:
    the case's)."""
    shape = tuple(self.shape if shape is None else shape)
    return [randn(key + i, a.shape(shape), dtype if a.dtype is None else a.dtype,
                  scale=a.scale, offset=a.offset) for i, a in enumerate(self.args)]

  @property
  def argnums(self) -> tuple[int, ...]:
    return tuple(i for i, a in enumerate(self.args) if a.differentiable)

  @property
  def split_specs(self) -> list:
    return [P(*a.split) for a in self.args]

  @property
  def result_spec(self):
    return P(*(self.args[0].split if self.out_split is None else self.out_split))

  @property
  def family(self) -> str:
    """The primitives' name (`jax_dnn_<family>_fwd`): ops of one family share
    their primitives and rules, and differ only in static parameters."""
    return self.targets[0].removeprefix("jax_dnn_").removesuffix("_fwd")


# --- references -----------------------------------------------------------------------


def _layer_norm(x, scale, bias, epsilon=1e-6):
  mean = x.mean(-1, keepdims=True)
  var = jnp.square(x - mean).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + epsilon) * scale + bias


def _rms_norm(x, scale, epsilon=1e-6):
  return x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + epsilon) * scale


# --- the table ------------------------------------------------------------------------

_ROWS = (8, 4, 32)  # [batch, rows, width]: split over "data" x "model" as [4, 2]
_ELEMENTWISE = Arg(scale=2.0, split=("data", None, "model"))
_UNARY = {  # name: (ours, JAX's own)
    "relu": (jax_dnn.relu, jax.nn.relu),
    "gelu": (functools.partial(jax_dnn.gelu, approximate=False),
             functools.partial(jax.nn.gelu, approximate=False)),
    "gelu_tanh": (functools.partial(jax_dnn.gelu, approximate=True),
                  functools.partial(jax.nn.gelu, approximate=True)),
    "silu": (jax_dnn.silu, jax.nn.silu),
    "sigmoid": (jax_dnn.sigmoid, jax.nn.sigmoid),
    "tanh": (jax_dnn.tanh, jnp.tanh),
}

CASES: list[OpCase] = [
    OpCase(name, ours, theirs, _ROWS, (_ELEMENTWISE,),
           ("jax_dnn_activation_fwd", "jax_dnn_activation_bwd"),
           check_grads=name != "relu")  # numerical differences straddle relu's kink
    for name, (ours, theirs) in _UNARY.items()
] + [
    OpCase(
        "bias_act",
        lambda x, bias: jax_dnn.bias_act(x, bias, "silu"),
        lambda x, bias: jax.nn.silu(x + bias),
        _ROWS,
        # Tensor-parallel MLP layout: columns split with the bias; dbias
        # summed over the devices holding rows.
        (_ELEMENTWISE, Arg(lambda s: s[-1:], split=("model",), batch=None)),
        ("jax_dnn_bias_act_fwd", "jax_dnn_bias_act_bwd")),
    # softmax along a middle axis (the strided kernel), log_softmax along the
    # last (the row kernels).
    OpCase(
        "softmax",
        lambda x: jax_dnn.softmax(x, axis=1),
        lambda x: jax.nn.softmax(x, axis=1),
        (8, 6, 32),
        (Arg(scale=3.0, split=("data", None, "model"), whole=(1,)),),
        ("jax_dnn_softmax_fwd", "jax_dnn_softmax_bwd")),
    OpCase(
        "log_softmax",
        jax_dnn.log_softmax,
        jax.nn.log_softmax,
        (8, 6, 32),
        (Arg(scale=3.0, split=("data", "model"), whole=(2,)),),
        ("jax_dnn_softmax_fwd", "jax_dnn_softmax_bwd")),
    OpCase(
        "layer_norm",
        lambda x, scale, bias: jax_dnn.layer_norm(x, scale, bias, epsilon=1e-6),
        _layer_norm,
        _ROWS,
        # An offset mean; fp32 parameters (bf16 inputs take them so).
        (Arg(scale=2.0, offset=1.0, split=("data", "model"), whole=(2,)),
         Arg(lambda s: s[-1:], jnp.float32, scale=0.5, offset=1.0, batch=None),
         Arg(lambda s: s[-1:], jnp.float32, scale=0.5, batch=None)),
        ("jax_dnn_layer_norm_fwd", "jax_dnn_layer_norm_bwd"),
        tol=5e-5),
    OpCase(
        "rms_norm",
        lambda x, scale: jax_dnn.rms_norm(x, scale, epsilon=1e-6),
        _rms_norm,
        _ROWS,
        (Arg(scale=2.0, split=("data", "model"), whole=(2,)),
         Arg(lambda s: s[-1:], jnp.float32, scale=0.5, offset=1.0, batch=None)),
        ("jax_dnn_rms_norm_fwd", "jax_dnn_rms_norm_bwd"),
        tol=5e-5),
    # Grouped-query attention (4 query heads on 2 key/value heads, T != S)
    # with a bias and a causal mask. Batch and heads split; the sequences
    # stay whole (the masks count positions from each sequence's start).
    OpCase(
        "dot_product_attention",
        lambda q, k, v, bias: jax_dnn.dot_product_attention(q, k, v, bias, is_causal=True),
        lambda q, k, v, bias: jax.nn.dot_product_attention(q, k, v, bias, is_causal=True),
        (4, 8, 4, 32),  # [B, T, N, H]
        (Arg(scale=0.5, split=("data", None, "model"), whole=(1,)),
         Arg(lambda s: (s[0], 12, s[2] // 2, s[3]), scale=0.5, split=("data", None, "model"),
             whole=(1,)),
         Arg(lambda s: (s[0], 12, s[2] // 2, s[3]), split=("data", None, "model"), whole=(1,)),
         Arg(lambda s: (s[0], s[2], s[1], 12), jnp.float32, split=("data", "model"))),
        ("jax_dnn_attention_fwd", "jax_dnn_attention_bwd"),
        tol=1e-4, rows=False, check_shape=(1, 3, 2, 8), vmap_keeps_batch_split=False),
]


# --- convolutions -------------------------------------------------------------------------

_NHWC = ("NHWC", "HWIO", "NHWC")
_CONV_TARGETS = ("jax_dnn_conv_fwd", "jax_dnn_conv_dgrad", "jax_dnn_conv_wgrad")


def _conv_ref(x, kernel, bias, residual):
  y = jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME", dimension_numbers=_NHWC)
  return jax.nn.silu(y + bias + residual)


def _grouped(fn):
  """A strided, dilated, grouped 2D convolution in NCHW (lax's default layout)."""
  return lambda x, w: fn(x, w, (2, 1), ((1, 2), (0, 1)), rhs_dilation=(1, 2),
                         feature_group_count=2)


def _transposed(fn):
  return lambda x, w: fn(x, w, (2, 2), "SAME", dimension_numbers=_NHWC)


CASES += [
    # The fused form: act(conv + bias + residual), NHWC with Flax's kernel.
    # The batch splits, and output channels with the kernel, the bias and the
    # residual; the spatial axes stay whole (windows cross shard edges).
    OpCase(
        "conv",
        lambda x, kernel, bias, residual: jax_dnn.conv(x, kernel, bias, residual=residual,
                                                       activation="silu"),
        _conv_ref,
        (8, 6, 5, 4),  # [N, H, W, C]
        (Arg(split=("data",), whole=(1,)),
         Arg(lambda s: (3, 3, s[-1], 6), scale=0.5, split=(None, None, None, "model"),
             batch=None),
         Arg(lambda s: (6,), split=("model",), batch=None),
         Arg(lambda s: s[:-1] + (6,), split=("data", None, None, "model"), whole=(1,))),
        _CONV_TARGETS,
        tol=1e-4, rows=False, check_shape=(2, 4, 3, 4), out_split=("data", None, None, "model"),
        vmap_keeps_batch_split=False, vmap_split_gathers=False,
        vmap_out_split=(None, "data"), lowering_here=False),
    OpCase(
        "conv_general_dilated",
        _grouped(jax_dnn.conv_general_dilated),
        _grouped(jax.lax.conv_general_dilated),
        (8, 4, 7, 6),  # [N, C, H, W]
        (Arg(split=("data",)), Arg(lambda s: (6, s[1] // 2, 3, 3), scale=0.5, batch=None)),
        _CONV_TARGETS,
        tol=1e-4, rows=False, check_shape=(2, 4, 5, 4), vmap_keeps_batch_split=False,
        vmap_split_gathers=False, vmap_out_split=(None, "data"), lowering_here=False),
    # lhs dilation 2: a strided data gradient, which runs as stride-1 forward
    # convolutions, one per phase (fp32: channels a multiple of 4, as the
    # forward's kernels take them); its backward the forward and wgrad.
    OpCase(
        "conv_transpose",
        _transposed(jax_dnn.conv_transpose),
        _transposed(jax.lax.conv_transpose),
        (8, 5, 4, 8),  # [N, H, W, C]
        (Arg(split=("data",)),
         Arg(lambda s: (3, 3, s[-1], 4), scale=0.5, split=(None, None, None, "model"),
             batch=None)),
        ("jax_dnn_conv_dgrad", "jax_dnn_conv_fwd", "jax_dnn_conv_wgrad"),
        tol=1e-4, rows=False, check_shape=(2, 3, 2, 4), out_split=("data", None, None, "model"),
        vmap_keeps_batch_split=False, vmap_split_gathers=False,
        vmap_out_split=(None, "data"), lowering_here=False),
    OpCase(
        "matmul",
        lambda x, w, bias: jax_dnn.matmul(x, w, bias, activation="gelu_tanh"),
        lambda x, w, bias: jax.nn.gelu(x @ w + bias, approximate=True),
        (8, 4, 32),
        (Arg(split=("data",)), Arg(lambda s: (s[-1], 16), scale=0.2, split=(None, "model"),
                                   batch=None),
         Arg(lambda s: (16,), split=("model",), batch=None)),
        _CONV_TARGETS,
        tol=1e-4, rows=False, check_shape=(2, 3, 8), out_split=("data", None, "model"),
        vmap_keeps_batch_split=False, vmap_split_gathers=False, vmap_out_split=(None, "data"), lowering_here=False),
]

# --- group norm and instance norm -----------------------------------------------------


def _group_norm(x, scale, bias, groups, activation=lambda z: z, epsilon=1e-6):
  n, c = x.shape[0], x.shape[-1]
  xg = x.reshape(n, -1, groups, c // groups)
  mean = xg.mean((1, 3), keepdims=True)
  var = jnp.square(xg - mean).mean((1, 3), keepdims=True)
  return activation(((xg - mean) * jax.lax.rsqrt(var + epsilon)).reshape(x.shape) * scale + bias)


# [N, H, W, C]: the batch splits (the parameter gradients summed over it);
# the spatial axes and channels stay whole (a group's statistics span them).
_NORM_X = Arg(scale=2.0, offset=1.0, split=("data",), whole=(1,))
_NORM_PARAMS = (Arg(lambda s: s[-1:], jnp.float32, scale=0.5, offset=1.0, batch=None),
                Arg(lambda s: s[-1:], jnp.float32, scale=0.5, batch=None))

CASES += [
    OpCase(
        "group_norm",
        lambda x, scale, bias: jax_dnn.group_norm(x, scale, bias, num_groups=4,
                                                  activation="silu"),
        lambda x, scale, bias: _group_norm(x, scale, bias, 4, jax.nn.silu),
        (8, 4, 3, 16),
        (_NORM_X,) + _NORM_PARAMS,
        ("jax_dnn_group_norm_fwd", "jax_dnn_group_norm_bwd"),
        tol=5e-5, rows=False, check_shape=(2, 3, 2, 8), vmap_keeps_batch_split=False),
    OpCase(
        "instance_norm",
        jax_dnn.instance_norm,
        lambda x, scale, bias: _group_norm(x, scale, bias, x.shape[-1]),
        (8, 6, 12),
        (_NORM_X,) + _NORM_PARAMS,
        ("jax_dnn_group_norm_fwd", "jax_dnn_group_norm_bwd"),
        tol=5e-5, rows=False, check_shape=(2, 5, 3), vmap_keeps_batch_split=False,
        # XLA runs it unless deterministic (group_norm_plan's by_default):
        # tests/test_group_norm.py lowers it both ways.
        lowering_here=False),
]

# --- pooling ------------------------------------------------------------------------------


def _adaptive_reference(x, output_size, reduce):
  """PyTorch's adaptive bins over x [N, *spatial, C], one slice a bin: the
  bins [floor(o * L / out), ceil((o + 1) * L / out)) of each axis."""
  for axis, out in enumerate(output_size, start=1):
    length = x.shape[axis]
    bins = [jax.lax.slice_in_dim(x, o * length // out, -(-(o + 1) * length // out), axis=axis)
            for o in range(out)]
    x = jnp.concatenate([reduce(b, axis=axis, keepdims=True) for b in bins], axis=axis)
  return x


# Channels-last [N, H, W, C]: batch and channels split, the spatial axes whole
# (windows cross any split of them). vmap folds its axis into N (as the
# convolutions do). Shapes whose windows overlap or whose bins are uneven,
# which the kernels take by default (jax_dnn/_src/pooling.py pool_plan):
# max_pool's gradient keeps argmax offsets; adaptive_max_pool's bins of
# 27 x 11 positions (more than 255) keep x and y.
_POOL = Arg(split=("data", None, None, "model"), whole=(1, 2))
_POOL_OPTS = dict(tol=1e-5, rows=False, vmap_keeps_batch_split=False)
CASES += [
    OpCase(
        "max_pool",
        lambda x: jax_dnn.max_pool(x, (3, 3), (2, 2), "SAME"),
        lambda x: flax_pooling.max_pool(x, (3, 3), (2, 2), "SAME"),
        (8, 6, 10, 4), (_POOL,),
        ("jax_dnn_max_pool_idx_fwd", "jax_dnn_max_pool_idx_bwd"), lowering_here=False,
        check_eps=1e-4, **_POOL_OPTS),
    OpCase(
        "avg_pool",
        lambda x: jax_dnn.avg_pool(x, (2, 3), (2, 1), ((1, 0), (1, 1)), count_include_pad=False),
        lambda x: flax_pooling.avg_pool(x, (2, 3), (2, 1), ((1, 0), (1, 1)),
                                        count_include_pad=False),
        (8, 6, 10, 4), (_POOL,), ("jax_dnn_avg_pool_fwd", "jax_dnn_avg_pool_bwd"), **_POOL_OPTS),
    OpCase(
        "adaptive_max_pool",
        lambda x: jax_dnn.adaptive_max_pool(x, (1, 3)),
        lambda x: _adaptive_reference(x, (1, 3), jnp.max),
        (8, 28, 31, 4), (_POOL,), ("jax_dnn_max_pool_fwd", "jax_dnn_max_pool_bwd"), **_POOL_OPTS),
    OpCase(
        "adaptive_avg_pool",
        lambda x: jax_dnn.adaptive_avg_pool(x, (4, 1)),
        lambda x: _adaptive_reference(x, (4, 1), jnp.mean),
        (8, 6, 10, 4), (_POOL,), ("jax_dnn_avg_pool_fwd", "jax_dnn_avg_pool_bwd"), **_POOL_OPTS),
]


# --- batch norm ----------------------------------------------------------------------------

_BN_TARGETS = ("jax_dnn_batch_norm_fwd", "jax_dnn_batch_norm_stats",
               "jax_dnn_batch_norm_bwd_stats", "jax_dnn_batch_norm_bwd")


def _batch_norm_ref(x, scale, bias, residual, epsilon=1e-5):
  axes = tuple(range(x.ndim - 1))
  mean = x.mean(axes)
  var = jnp.square(x - mean).mean(axes)
  return jax.nn.silu((x - mean) * jax.lax.rsqrt(var + epsilon) * scale + bias + residual)


def _batch_norm_inference_ref(x, mean, var, scale, bias, epsilon=1e-5):
  return jax.nn.gelu((x - mean) * jax.lax.rsqrt(var + epsilon) * scale + bias, approximate=True)


CASES += [
    # Training mode with a fused residual and SiLU, NHWC. Channels split,
    # with the parameters. (The batch splits too, its per-channel sums added
    # over the devices, under jit; but inside shard_map a device's block is
    # its batch unless axis_name says otherwise, as in Flax: test_batch_norm
    # splits the batch.)
    OpCase(
        "batch_norm",
        lambda x, scale, bias, residual: jax_dnn.batch_norm(
            x, scale, bias, residual=residual, activation="silu")[0],
        _batch_norm_ref,
        (8, 3, 2, 32),  # [N, H, W, C]
        (Arg(scale=2.0, offset=1.0, split=(None, None, None, "model")),
         Arg(lambda s: s[-1:], jnp.float32, scale=0.5, offset=1.0, split=("model",), batch=None),
         Arg(lambda s: s[-1:], jnp.float32, scale=0.5, split=("model",), batch=None),
         Arg(split=(None, None, None, "model"))),
        _BN_TARGETS,
        tol=5e-5),
    # Inference mode (given statistics) with the tanh GELU: one elementwise
    # pass; its backward the two reductions' kernels.
    OpCase(
        "batch_norm_inference",
        lambda x, mean, var, scale, bias: jax_dnn.batch_norm_inference(
            x, mean, var, scale, bias, activation="gelu_tanh"),
        _batch_norm_inference_ref,
        (8, 4, 32),
        (Arg(scale=2.0, offset=1.0, split=("data", None, "model")),
         Arg(lambda s: s[-1:], jnp.float32, offset=1.0, split=("model",), batch=None),
         Arg(lambda s: s[-1:], jnp.float32, scale=0.3, offset=2.0, split=("model",), batch=None),
         Arg(lambda s: s[-1:], jnp.float32, scale=0.5, offset=1.0, split=("model",), batch=None),
         Arg(lambda s: s[-1:], jnp.float32, scale=0.5, split=("model",), batch=None)),
        ("jax_dnn_batch_norm_fwd", "jax_dnn_batch_norm_bwd_stats", "jax_dnn_batch_norm_bwd"),
        tol=5e-5),
]

# --- recurrent networks --------------------------------------------------------------------

_RNN_HIDDEN = 4
_RNN_GATES = {"lstm": 4, "gru": 3, "rnn": 1}


def _rnn_weights_shape(mode):
  """The flat weight vector of one unidirectional layer over x [B, T, I]."""
  g, h = _RNN_GATES[mode], _RNN_HIDDEN
  return lambda s: (g * h * (s[-1] + h + 2),)


def _full_lengths(x):
  return jnp.full((x.shape[0],), x.shape[1], jnp.int32)


def _recurrent_ref(mode, x, h_0, c_0, w):
  """One layer over every step of x [B, T, I] (PyTorch's equations)."""
  g, h, i = _RNN_GATES[mode], _RNN_HIDDEN, x.shape[-1]
  sizes = (g * h * i, g * h * h, g * h, g * h)
  w_ih, w_hh, b_ih, b_hh = jnp.split(w, np.cumsum(sizes)[:-1])
  w_ih, w_hh = w_ih.reshape(g * h, i), w_hh.reshape(g * h, h)

  def step(carry, xt):
    hs, cs = carry
    zi, zh = xt @ w_ih.T + b_ih, hs @ w_hh.T + b_hh
    if mode == "lstm":
      i_, f, gg, o = jnp.split(zi + zh, 4, axis=-1)
      cs = jax.nn.sigmoid(f) * cs + jax.nn.sigmoid(i_) * jnp.tanh(gg)
      hs = jax.nn.sigmoid(o) * jnp.tanh(cs)
    elif mode == "gru":
      r = jax.nn.sigmoid(zi[:, :h] + zh[:, :h])
      u = jax.nn.sigmoid(zi[:, h:2 * h] + zh[:, h:2 * h])
      hs = (1 - u) * jnp.tanh(zi[:, 2 * h:] + r * zh[:, 2 * h:]) + u * hs
    else:
      hs = jnp.tanh(zi + zh)
    return (hs, cs), hs

  c_init = c_0[0] if mode == "lstm" else h_0[0]
  return jnp.swapaxes(jax.lax.scan(step, (h_0[0], c_init), jnp.swapaxes(x, 0, 1))[1], 0, 1)


# x [B, T, I]; h_0, c_0 [1, B, H]; the flat weights. The batch splits (with
# the states); time and features stay whole; the weights are replicated
# (their gradients summed over the batch by XLA's GEMMs). The output is y
# alone.
_RNN_X = Arg(split=("data",), whole=(1, 2))
_RNN_STATE = Arg(lambda s: (1, s[0], _RNN_HIDDEN), scale=0.5, split=(None, "data"), batch=1)
_RNN_OPTS = dict(tol=5e-5, rows=False, check_shape=(2, 3, 2), symbolic_batch=False,
                 vmap_all_kernels=False)
_RNN_TARGETS = ("jax_dnn_rnn_fwd", "jax_dnn_rnn_bwd")
CASES += [
    OpCase(
        "lstm",
        lambda x, h_0, c_0, w: jax_dnn.lstm(x, h_0, c_0, w, _full_lengths(x), x.shape[-1],
                                            _RNN_HIDDEN, 1, 0.0, False)[0],
        functools.partial(_recurrent_ref, "lstm"),
        (8, 4, 6),
        (_RNN_X, _RNN_STATE, _RNN_STATE,
         Arg(_rnn_weights_shape("lstm"), scale=0.3, batch=None)),
        _RNN_TARGETS, **_RNN_OPTS),
    OpCase(
        "gru",
        lambda x, h_0, w: jax_dnn.gru(x, h_0, w, _full_lengths(x), x.shape[-1], _RNN_HIDDEN, 1,
                                      0.0, False)[0],
        lambda x, h_0, w: _recurrent_ref("gru", x, h_0, None, w),
        (8, 4, 6),
        (_RNN_X, _RNN_STATE, Arg(_rnn_weights_shape("gru"), scale=0.3, batch=None)),
        _RNN_TARGETS, **_RNN_OPTS),
    OpCase(
        "rnn",
        lambda x, h_0, w: jax_dnn.rnn(x, h_0, w, _full_lengths(x), x.shape[-1], _RNN_HIDDEN, 1,
                                      0.0, False)[0],
        lambda x, h_0, w: _recurrent_ref("rnn", x, h_0, None, w),
        (8, 4, 6),
        (_RNN_X, _RNN_STATE, Arg(_rnn_weights_shape("rnn"), scale=0.3, batch=None)),
        _RNN_TARGETS, **_RNN_OPTS),
]

# Public functions that are no ops (they run nothing): no case. The
# recurrent weight-layout helpers reshape, initialize and convert weights;
# fuse transforms a function (tests/test_fuse.py).
NOT_OPS = frozenset({"conv_algorithms", "fuse", "get_num_params_in_gru", "get_num_params_in_lstm",
                     "get_num_params_in_rnn", "pool_plan", "init_gru_weight", "init_lstm_weight",
                     "init_rnn_weight", "pack_rnn_weights", "rnn_weights_from_torch",
                     "rnn_weights_to_torch", "unpack_gru_weights", "unpack_lstm_weights",
                     "unpack_rnn_weights"})

BY_NAME = {c.name: c for c in CASES}
NAMES = list(BY_NAME)


def one_per_family(cases=CASES, where=lambda c: True) -> list[str]:
  """The first case (satisfying `where`) of each family: for tests of the
  primitives' rules (batching, sharding, transposition), which static
  parameters such as the activation do not change."""
  seen, names = set(), []
  for c in cases:
    if where(c) and c.family not in seen:
      seen.add(c.family)
      names.append(c.name)
  return names

