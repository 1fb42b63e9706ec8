"""jax_dnn.fuse: each pattern replaced where written as JAX/Flax write it
(the fused jaxpr holds the jax_dnn primitive, its CUDA lowering our custom
call), left alone with a reason where it is not, and the fused program equal
to the original in values and gradients under jit, grad, vmap, scan and
checkpoint."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_dnn
from helpers import cuda_hlo, on_gpu, randn, require_kernels


def _prims(fn, *args):
  """The primitive names of fn's jaxpr, nested jaxprs included."""
  names = set()

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      names.add(eqn.primitive.name)
      for p in eqn.params.values():
        for sub in p if isinstance(p, (tuple, list)) else (p,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return names


def _attention(q, k, v, *, causal=False, mask=None, bias=None, layout="bthd"):
  d = q.shape[-1]
  if layout == "bthd":
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
  else:  # [B, N, T, H] with jnp.matmul
    s = q @ jnp.swapaxes(k, -1, -2)
  s = s / jnp.sqrt(d).astype(q.dtype)
  if bias is not None:
    s = s + bias
  if causal:
    s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
  if mask is not None:
    s = jnp.where(mask, s, jnp.finfo(s.dtype).min)
  p = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(q.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v) if layout == "bthd" else p @ v


def _close(a, b, dtype):
  tol = 5e-2 if dtype in (jnp.bfloat16, jnp.float16) else 1e-5
  np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol,
                             rtol=tol)


def _qkv(shape, dtype):
  return [randn(i, shape, dtype) for i in range(3)]


@pytest.mark.parametrize("case", ["plain", "causal", "mask", "bias", "matmul"])
def test_attention_fused(device, case):
  shape = (2, 33, 4, 32) if case != "matmul" else (2, 4, 33, 32)
  q, k, v = _qkv(shape, jnp.bfloat16)
  opts = dict(causal=case == "causal", layout="bnth" if case == "matmul" else "bthd")
  if case == "mask":
    opts["mask"] = jax.random.bernoulli(jax.random.key(3), 0.8, (2, 1, 33, 33)).at[..., 0].set(True)
  if case == "bias":
    opts["bias"] = randn(4, (1, 4, 33, 33), jnp.bfloat16)
  fn = functools.partial(_attention, **opts)
  fused = jax_dnn.fuse(fn)
  report = fused.explain(q, k, v)
  assert [m["pattern"] for m in report.fused] == ["attention"], report
  assert ("is_causal" in report.fused[0]["op"]) == (case == "causal")
  assert "jax_dnn_attention_fwd" in _prims(fused, q, k, v)
  _close(jax.jit(fused)(q, k, v), jax.jit(fn)(q, k, v), jnp.bfloat16)
  loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) * a[0].astype(jnp.float32))
  for g, r in zip(jax.jit(jax.grad(loss(fused), (0, 1, 2)))(q, k, v),
                  jax.jit(jax.grad(loss(fn), (0, 1, 2)))(q, k, v)):
    _close(g, r, jnp.bfloat16)
  if on_gpu(device):
    require_kernels()
    assert "jax_dnn_attention_fwd" in cuda_hlo(fused, q, k, v)


def test_attention_near_misses(device):
  del device
  q, k, v = _qkv((2, 16, 4, 12), jnp.bfloat16)  # head dim 12: no kernel
  report = jax_dnn.fuse(_attention).explain(q, k, v)
  assert [m["pattern"] for m in report.fused] == ["softmax"]  # the softmax alone
  assert "head dims 12" in report.missed[0]["reason"]
  q, k, v = _qkv((2, 16, 4, 32), jnp.float32)
  report = jax_dnn.fuse(_attention).explain(q, k, v)
  assert not any(m["pattern"] == "attention" for m in report.fused)
  assert "float32" in report.missed[0]["reason"]

  def scores_kept(q, k, v):  # the probabilities are an output too
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v), p
  q, k, v = _qkv((2, 16, 4, 32), jnp.bfloat16)
  fused = jax_dnn.fuse(scores_kept)
  report = fused.explain(q, k, v)
  assert "used elsewhere" in report.missed[0]["reason"]
  for a, b in zip(fused(q, k, v), scores_kept(q, k, v)):
    _close(a, b, jnp.bfloat16)


@pytest.mark.parametrize("layer", ["layer_norm", "layer_norm_slow", "rms_norm", "bf16"])
def test_norms_fused(device, layer):
  del device
  rngs = nnx.Rngs(0)
  dtype = jnp.bfloat16 if layer == "bf16" else jnp.float32
  if layer == "rms_norm":
    model = nnx.RMSNorm(64, rngs=rngs)
  else:
    model = nnx.LayerNorm(64, use_fast_variance=layer != "layer_norm_slow", dtype=dtype,
                          rngs=rngs)
  # Parameters other than ones and zeros, so that each is checked.
  for name in ("scale", "bias"):
    p = getattr(model, name, None)
    if p is not None:
      p.value = randn(5, p.value.shape, p.value.dtype, 0.5, 1.0)
  x = randn(6, (4, 9, 64), dtype, 2.0, 0.5)
  fn = lambda x: model(x)
  fused = jax_dnn.fuse(fn)
  report = fused.explain(x)
  want = "rms_norm" if layer == "rms_norm" else "layer_norm"
  assert [m["pattern"] for m in report.fused] == [want], report
  assert f"jax_dnn_{want}_fwd" in _prims(fused, x)
  y = jax.jit(fused)(x)
  assert y.dtype == fn(x).dtype
  _close(y, fn(x), dtype)
  _close(jax.grad(lambda x: jnp.sum(fused(x) ** 2))(x), jax.grad(lambda x: jnp.sum(fn(x) ** 2))(x),
         dtype)


def test_norm_promoted_is_left(device):
  del device
  model = nnx.LayerNorm(64, rngs=nnx.Rngs(0))  # bf16 x, float32 params: a float32 result
  x = randn(1, (4, 64), jnp.bfloat16)
  report = jax_dnn.fuse(lambda x: model(x)).explain(x)
  assert not report.fused and "conversion pass" in report.missed[0]["reason"]


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_softmax_fused(device, axis):
  del device
  x = randn(2, (6, 7, 40), jnp.float32, 3.0)
  fn = lambda x: (jax.nn.softmax(x, axis=axis), jax.nn.log_softmax(x, axis=axis))
  fused = jax_dnn.fuse(fn)
  assert sorted(m["pattern"] for m in fused.explain(x).fused) == ["log_softmax", "softmax"]
  for a, b in zip(fused(x), fn(x)):
    _close(a, b, jnp.float32)
  loss = lambda f: lambda x: jnp.sum(f(x)[0] * x) + jnp.sum(f(x)[1] * x)
  _close(jax.grad(loss(fused))(x), jax.grad(loss(fn))(x), jnp.float32)


_POOLS = {
    "max": lambda x: nnx.max_pool(x, (3, 3), (2, 2), "SAME"),
    "avg": lambda x: nnx.avg_pool(x, (3, 3), (2, 2), "SAME"),
    "avg_exclude_pad": lambda x: nnx.avg_pool(x, (3, 3), (2, 2), "SAME", count_include_pad=False),
    "global_mean": lambda x: jnp.mean(x, axis=(1, 2)),
    "max_1d": lambda x: nnx.max_pool(x.reshape(2, 99, 16), (4,), (3,), ((1, 2),)),
}
_POOL_PRIM = {"max": "jax_dnn_max_pool_fwd", "max_1d": "jax_dnn_max_pool_fwd"}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", sorted(_POOLS))
def test_pooling_fused(device, case, dtype):
  fn = _POOLS[case]
  x = randn(8, (2, 11, 9, 16), dtype)
  fused = jax_dnn.fuse(fn)
  report = fused.explain(x)
  want = "max_pool" if case.startswith("max") else "avg_pool"
  assert [m["pattern"] for m in report.fused] == [want], report
  assert _POOL_PRIM.get(case, "jax_dnn_avg_pool_fwd") in _prims(fused, x)
  y = jax.jit(fused)(x)
  assert y.dtype == fn(x).dtype and y.shape == fn(x).shape
  _close(y, fn(x), dtype)
  w = randn(9, y.shape, jnp.float32)
  loss = lambda f: lambda x: jnp.sum(f(x).astype(jnp.float32) * w)
  _close(jax.grad(loss(fused))(x), jax.grad(loss(fn))(x), dtype)
  if on_gpu(device):
    require_kernels()
    assert _POOL_PRIM.get(case, "jax_dnn_avg_pool_fwd") in cuda_hlo(fused, x)


def test_pooling_left_alone(device):
  del device
  x = randn(1, (2, 8, 8, 4), jnp.float32)
  padded = lambda x: nnx.avg_pool(x, (2, 2), (2, 2), ((3, 3), (0, 0)), count_include_pad=False)
  report = jax_dnn.fuse(padded).explain(x)
  assert not report.fused and "wholly in the padding" in report.missed[0]["reason"]
  dilated = lambda x: jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 1, 1, 1),
                                            "VALID", window_dilation=(1, 2, 2, 1))
  report = jax_dnn.fuse(dilated).explain(x)
  assert not report.fused and "dilated" in report.missed[0]["reason"]
  features = lambda x: jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 1, 1, 2),
                                             (1, 1, 1, 2), "VALID")
  report = jax_dnn.fuse(features).explain(x)
  assert not report.fused and "feature" in report.missed[0]["reason"]
  centered = lambda x: x - jnp.mean(x, axis=(1, 2), keepdims=True)  # a statistic, no pooling
  assert not jax_dnn.fuse(centered).explain(x).fused
  ints = jnp.arange(2 * 8 * 8 * 4).reshape(x.shape)  # no kernel: nothing to gain
  assert not jax_dnn.fuse(_POOLS["max"]).explain(ints).fused
  np.testing.assert_array_equal(jax_dnn.fuse(_POOLS["max"])(ints), _POOLS["max"](ints))


_GROUP_NORMS = {  # module, the activation after it
    "group_norm": (lambda dt: nnx.GroupNorm(32, num_groups=8, dtype=dt, rngs=nnx.Rngs(0)), None),
    "group_norm_silu": (lambda dt: nnx.GroupNorm(32, num_groups=4, dtype=dt, rngs=nnx.Rngs(0)),
                        nnx.silu),
    "group_norm_two_pass_gelu": (lambda dt: nnx.GroupNorm(32, num_groups=8, dtype=dt,
                                                          use_fast_variance=False,
                                                          rngs=nnx.Rngs(0)), nnx.gelu),
    "group_norm_plain_relu": (lambda dt: nnx.GroupNorm(32, num_groups=16, use_scale=False,
                                                       use_bias=False, dtype=dt,
                                                       rngs=nnx.Rngs(0)), nnx.relu),
    "instance_norm_relu": (lambda dt: nnx.InstanceNorm(32, dtype=dt, rngs=nnx.Rngs(0)),
                           jax.nn.relu),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", sorted(_GROUP_NORMS))
def test_group_norm_fused(device, case, dtype):
  make, act = _GROUP_NORMS[case]
  graphdef, params = nnx.split(make(dtype))
  params = jax.tree.map(lambda p: randn(5, p.shape, p.dtype, 0.5, 1.0), params)

  def fn(params, x):
    y = nnx.merge(graphdef, params)(x)
    return y if act is None else act(y)
  x = randn(6, (2, 5, 7, 32), dtype, 2.0, 0.5)
  fused = jax_dnn.fuse(fn)
  report = fused.explain(params, x)
  want = case.split("_norm")[0] + "_norm"
  assert [m["pattern"] for m in report.fused] == ["group_norm"] and want in report.fused[0]["op"]
  assert (act is None) == ("activation" not in report.fused[0]["op"]), report
  assert not report.missed, report
  assert "jax_dnn_group_norm_fwd" in _prims(fused, params, x)
  y = jax.jit(fused)(params, x)
  assert y.dtype == fn(params, x).dtype == dtype
  _close(y, fn(params, x), dtype)
  w = randn(9, y.shape, jnp.float32)
  loss = lambda f: lambda p, x: jnp.sum(f(p, x).astype(jnp.float32) * w)
  for g, r in zip(jax.tree.leaves(jax.grad(loss(fused), (0, 1))(params, x)),
                  jax.tree.leaves(jax.grad(loss(fn), (0, 1))(params, x))):
    _close(g, r, dtype)
  if on_gpu(device):
    require_kernels()
    assert "jax_dnn_group_norm_fwd" in cuda_hlo(fused, params, x)


def _cell_params(cell):
  """cell's parameters, random (not its init), and the rest of its state."""
  graphdef, params, rest = nnx.split(cell, nnx.Param, ...)
  params = jax.tree.map(lambda p: randn(3, p.shape, p.dtype, 0.4), params)
  return graphdef, params, rest


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("cell,reverse", [("OptimizedLSTMCell", False),
                                          ("OptimizedLSTMCell", True), ("LSTMCell", False)])
def test_lstm_scan_fused(device, cell, reverse, dtype):
  """nnx.RNN over an LSTM cell (Flax's bf16 cell: bf16 gates, float32
  state) -> one recurrence over the sequence."""
  layer = nnx.RNN(getattr(nnx, cell)(12, 24, dtype=dtype, rngs=nnx.Rngs(0)), reverse=reverse)
  graphdef, params, rest = _cell_params(layer)
  carry = (randn(4, (3, 24), jnp.float32, 0.3), randn(5, (3, 24), jnp.float32, 0.3))
  fn = lambda params, x: nnx.merge(graphdef, params, rest)(x, initial_carry=carry)
  x = randn(6, (3, 9, 12), dtype)
  fused = jax_dnn.fuse(fn)
  report = fused.explain(params, x)
  assert [m["pattern"] for m in report.fused] == ["lstm"] and not report.missed, report
  assert "jax_dnn_rnn_fwd" in _prims(fused, params, x)
  y = jax.jit(fused)(params, x)
  assert y.dtype == fn(params, x).dtype
  _close(y, fn(params, x), dtype)
  w = randn(9, y.shape, jnp.float32)
  loss = lambda f: lambda p, x: jnp.sum(f(p, x).astype(jnp.float32) * w)
  for g, r in zip(jax.tree.leaves(jax.grad(loss(fused), (0, 1))(params, x)),
                  jax.tree.leaves(jax.grad(loss(fn), (0, 1))(params, x))):
    _close(g, r, dtype)
  if on_gpu(device):
    require_kernels()
    assert "jax_dnn_rnn_fwd" in cuda_hlo(fused, params, x)


def test_lstm_scan_by_hand_and_look_alikes(device):
  """A hand-written scan over nnx.LSTMCell fuses; a scan whose step is no
  LSTM step (GRU, a scaled output) stays as written."""
  del device
  graphdef, params, rest = _cell_params(nnx.LSTMCell(8, 16, rngs=nnx.Rngs(0)))
  xs = randn(1, (6, 2, 8), jnp.float32)
  carry = (randn(2, (2, 16), jnp.float32), randn(3, (2, 16), jnp.float32))

  def by_hand(params, xs, scale=1.0):
    cell = nnx.merge(graphdef, params, rest)
    def step(carry, x):
      (c, h), y = cell(carry, x)
      return (c, h * scale), y
    return jax.lax.scan(step, carry, xs)
  fused = jax_dnn.fuse(by_hand)
  assert [m["pattern"] for m in fused.explain(params, xs).fused] == ["lstm"]
  for a, b in zip(jax.tree.leaves(fused(params, xs)), jax.tree.leaves(by_hand(params, xs))):
    _close(a, b, jnp.float32)
  scaled = jax_dnn.fuse(functools.partial(by_hand, scale=0.5))
  report = scaled.explain(params, xs)
  assert not report.fused and "not an LSTM step" in report.missed[0]["reason"]
  for a, b in zip(jax.tree.leaves(scaled(params, xs)), jax.tree.leaves(by_hand(params, xs, 0.5))):
    _close(a, b, jnp.float32)
  gru = nnx.RNN(nnx.GRUCell(8, 16, rngs=nnx.Rngs(0)))
  g_def, g_params, g_rest = _cell_params(gru)
  run = lambda p, x: nnx.merge(g_def, p, g_rest)(x, initial_carry=carry[0])
  assert not jax_dnn.fuse(run).explain(g_params, xs.swapaxes(0, 1)).fused


@pytest.mark.parametrize("spelling", ["relu", "maximum", "gelu", "gelu_exact", "silu", "swish",
                                      "sigmoid", "tanh", "scaled", "silu_plus_x"])
def test_activation_recognized(spelling):
  """The activation after a value, from how it is computed: each of the
  kernels' activations in its jax.nn / jnp spellings; other functions none."""
  from jax_dnn._src.fuse import graph as graph_lib  # pylint: disable=g-import-not-at-top
  from jax_dnn._src.fuse.patterns import activation  # pylint: disable=g-import-not-at-top
  fns = {"relu": (jax.nn.relu, "relu"), "maximum": (lambda v: jnp.maximum(v, 0), "relu"),
         "gelu": (jax.nn.gelu, "gelu_tanh"),
         "gelu_exact": (functools.partial(jax.nn.gelu, approximate=False), "gelu"),
         "silu": (nnx.silu, "silu"), "swish": (jax.nn.swish, "silu"),
         "sigmoid": (jax.nn.sigmoid, "sigmoid"), "tanh": (jnp.tanh, "tanh"),
         "scaled": (lambda v: 2 * v, None), "silu_plus_x": (lambda v: nnx.silu(v) + v, None)}
  fn, want = fns[spelling]
  for dtype in (jnp.float32, jnp.bfloat16):
    closed = graph_lib.flatten(jax.make_jaxpr(lambda x: fn(x * 1.5))(jnp.ones((4, 8), dtype)))
    g = graph_lib.Graph(closed.jaxpr, dict(zip(closed.jaxpr.constvars, closed.consts)))
    found = activation.after(g, g.eqns[0].outvars[0])
    assert (found and found[0]) == want, (spelling, dtype, found)
    if want:
      assert found[1] is closed.jaxpr.outvars[0]


def test_transforms_and_bodies(device):
  """vmap and checkpoint of a fused function; patterns inside scan, cond and
  remat bodies."""
  del device
  x = randn(7, (3, 5, 16), jnp.float32)

  def body(c, row):
    return c + jax.nn.softmax(row), None

  def prog(x):
    y = jax.lax.scan(body, jnp.zeros(x.shape[1:]), x)[0]
    z = jax.lax.cond(y.sum() > 0, jax.nn.log_softmax, lambda a: a * 2, y)
    return jax.checkpoint(jax.nn.softmax)(z)
  fused = jax_dnn.fuse(prog)
  got = sorted(m["pattern"] for m in fused.explain(x).fused)
  assert got == ["log_softmax", "softmax", "softmax"], got
  _close(jax.jit(fused)(x), prog(x), jnp.float32)
  _close(jax.grad(lambda x: jnp.sum(fused(x) ** 3))(x), jax.grad(lambda x: jnp.sum(prog(x) ** 3))(x),
         jnp.float32)
  xs = jnp.stack([x, x * 2])
  _close(jax.vmap(fused)(xs), jax.vmap(prog)(xs), jnp.float32)
  _close(jax.checkpoint(fused)(x), prog(x), jnp.float32)


def test_bad_input():
  with pytest.raises(TypeError, match="callable"):
    jax_dnn.fuse(3)
  with pytest.raises(ValueError, match="unknown patterns"):
    jax_dnn.fuse(jnp.sin, patterns=["conv_bias_relu_x"])
  x = jnp.ones((4, 8))
  fused = jax_dnn.fuse(lambda x: jax.nn.softmax(x), patterns=["layer_norm"])
  assert not fused.explain(x).fused
