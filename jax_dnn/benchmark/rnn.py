"""Recurrent networks: jax_dnn.lstm / gru / rnn against cuDNN through
jax.experimental.rnn.lstm (LSTM in fp32, the only form it takes) and against
a jitted lax.scan over the same recurrence, on the same inputs, in ms (and
us a time step): a recurrence's cost is its latency a step, not bytes or FLOPs.

B batch, T time steps, H hidden features (input features = H), L layers,
D directions. x [B, T, H] in the case's dtype, h_0 (and c_0) [L * D, B, H]
in that dtype, the flat weight vector fp32 (parameters kept in fp32 and
computed in the dtype, as a mixed-precision model holds them), seq_lengths
[B] int32: T for every row, or with `ragged` spread over [T / 8, T] (row 0
at T; no zero lengths, on which cuDNN fails, jax #17966). The function timed
returns y; fwd+bwd differentiates x, h_0, c_0 and the weights.

The scan ("scan") is what a JAX user writes, as Flax's cells run: per layer
and direction, the input projection of every step as one GEMM, then a
lax.scan whose step multiplies h_{t-1} (in the dtype) by W_hh cast from fp32
inside the step (so W_hh's gradient accumulates in fp32 across steps, as a
Flax cell's does), fp32 gates and cell state, steps beyond a row's length
leaving its state alone and giving zero outputs, the reverse direction a
reversed scan (each row backwards within its length). It is the reference
the error column checks ours (and cuDNN) against.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

import jax_dnn
from jax_dnn.benchmark import harness

MODES = ("fwd", "fwd+bwd")
DTYPES = ("bfloat16", "float32")
_SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
_GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1}
RAGGED_T = 512  # the ragged bidirectional LSTM's T (the issue gives its B and H)


def network(op: str, batch: int, steps: int, hidden: int, dtype: str, *, layers: int = 1,
            bidirectional: bool = False, ragged: bool = False) -> harness.Case:
  shape = f"B{batch} T{steps} H{hidden}"
  extra = (f" L{layers}" if layers > 1 else "") + (" bidir" if bidirectional else "") + (
      " ragged" if ragged else "")
  return harness.Case(op=op, shape=(batch, steps, hidden), dtype=dtype,
                      label=f"{op} {shape}{extra} {_SHORT[dtype]}",
                      options=(("layers", layers), ("bidirectional", bidirectional),
                               ("ragged", ragged)), modes=MODES)


def _shapes():
  """(op, B, T, H, options) of the sweep, dtype aside."""
  first = ((16, 1024, 768), (64, 256, 512))
  shapes = [("lstm", *s, {}) for s in first + ((256, 128, 1024),)]
  shapes.append(("lstm", 64, 256, 512, dict(layers=2)))
  shapes += [("lstm", b, 1000, h, {}) for h in (64, 128, 256) for b in (8, 64, 256)]
  shapes.append(("lstm", 32, RAGGED_T, 1024, dict(layers=3, bidirectional=True, ragged=True)))
  shapes.append(("lstm", 2, 131072, 128, {}))
  shapes += [(op, *s, {}) for op in ("gru", "rnn_tanh") for s in first]
  return shapes


def all_cases() -> list[harness.Case]:
  return [network(op, b, t, h, dtype, **options)
          for op, b, t, h, options in _shapes() for dtype in DTYPES]


def cases(quick: bool) -> list[harness.Case]:
  """The sweep; --quick: the first LSTM shape in bf16."""
  full = all_cases()
  return full[:1] if quick else full


# The scan.


def _cell(op, gx_t, hh, h, c):
  """One step in fp32 (jax_dnn.lstm/gru/rnn's equations): gx_t the input
  projection, hh = W_hh h_{t-1} + b_hh. Returns h_t, c_t."""
  if op == "lstm":
    zi, zf, zg, zo = jnp.split(gx_t + hh, 4, axis=-1)
    c = jax.nn.sigmoid(zf) * c + jax.nn.sigmoid(zi) * jnp.tanh(zg)
    return jax.nn.sigmoid(zo) * jnp.tanh(c), c
  if op == "gru":
    xr, xz, xn = jnp.split(gx_t, 3, axis=-1)
    hr, hz, hn = jnp.split(hh, 3, axis=-1)
    r, u = jax.nn.sigmoid(xr + hr), jax.nn.sigmoid(xz + hz)
    n = jnp.tanh(xn + r * hn)
    return (1.0 - u) * n + u * h, c
  if op == "rnn_tanh":
    return jnp.tanh(gx_t + hh), c
  raise ValueError(f"unknown recurrent benchmark op {op!r}")


_UNPACK = {"lstm": jax_dnn.unpack_lstm_weights, "gru": jax_dnn.unpack_gru_weights,
           "rnn_tanh": jax_dnn.unpack_rnn_weights}


def scan_network(op, x, h_0, c_0, weights, seq_lengths, *, layers: int, bidirectional: bool):
  """(y, h_n, c_n) of the network by lax.scan (module doc); c_0 and c_n are
  None except for LSTM."""
  batch, steps, size = x.shape
  hidden = h_0.shape[-1]
  dtype, f32 = x.dtype, jnp.float32
  dirs = 2 if bidirectional else 1
  w_ih, w_hh, b_ih, b_hh = _UNPACK[op](weights, size, hidden, layers, bidirectional)
  valid = jnp.arange(steps)[:, None] < seq_lengths[None, :]  # [T, B]
  inputs = jnp.swapaxes(x, 0, 1)  # [T, B, I]
  h_n, c_n = [], []
  for layer in range(layers):
    outs = []
    for d in range(dirs):
      p = layer * dirs + d
      gx = (jnp.einsum("tbi,gi->tbg", inputs, w_ih[p].astype(dtype), preferred_element_type=f32)
            + b_ih[p]).astype(dtype)
      w, b = w_hh[p], b_hh[p]

      def step(carry, xs, w=w, b=b):
        h, c = carry
        gx_t, ok = xs
        hh = jnp.dot(h.astype(dtype), w.astype(dtype).T, preferred_element_type=f32) + b
        h_t, c_t = _cell(op, gx_t.astype(f32), hh, h, c)
        ok = ok[:, None]
        return ((jnp.where(ok, h_t, h), jnp.where(ok, c_t, c)),
                jnp.where(ok, h_t, 0.0).astype(dtype))

      c_init = c_0[p].astype(f32) if op == "lstm" else jnp.zeros((batch, 0), f32)
      (h, c), y = lax.scan(step, (h_0[p].astype(f32), c_init), (gx, valid), reverse=bool(d))
      outs.append(y)
      h_n.append(h.astype(h_0.dtype))
      c_n.append(c)
    inputs = outs[0] if dirs == 1 else jnp.concatenate(outs, axis=-1)
  return (jnp.swapaxes(inputs, 0, 1), jnp.stack(h_n),
          jnp.stack(c_n).astype(c_0.dtype) if op == "lstm" else None)


# One case's inputs and functions.


def lengths(case: harness.Case):
  """seq_lengths: T everywhere, or spread over [T / 8, T] with row 0 at T."""
  batch, steps, _ = case.shape
  if not case.option("ragged"):
    return jnp.full((batch,), steps, jnp.int32)
  spread = jax.random.randint(jax.random.key(1), (batch,), max(1, steps // 8), steps + 1)
  return spread.at[0].set(steps).astype(jnp.int32)


def _cudnn_lstm():
  """jax.experimental.rnn.lstm, or why it cannot run here."""
  if jax.devices()[0].platform != "gpu":
    return "jax.experimental.rnn.lstm (cuDNN) runs on CUDA GPUs only"
  try:
    from jax.experimental import rnn as jax_rnn  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    return f"jax.experimental.rnn unavailable: {harness.short_reason(e)}"
  return jax_rnn.lstm


def functions(case: harness.Case, seq_lengths) -> dict:
  """impl -> f(x, h_0, [c_0,] weights) -> y."""
  op = case.op
  _, _, hidden = case.shape
  layers, bidirectional = case.option("layers"), case.option("bidirectional")
  shape = (hidden, hidden, layers, 0.0, bidirectional)  # input_size .. bidirectional

  def scan(x, h_0, *rest):
    c_0, weights = rest if op == "lstm" else (None, *rest)
    return scan_network(op, x, h_0, c_0, weights, seq_lengths, layers=layers,
                        bidirectional=bidirectional)[0]

  if op == "lstm":
    fns = {"ours": lambda x, h_0, c_0, w: jax_dnn.lstm(x, h_0, c_0, w, seq_lengths, *shape)[0]}
    cudnn = _cudnn_lstm()
    if isinstance(cudnn, str):
      fns["cudnn"] = cudnn
    elif case.dtype != "float32":
      fns["cudnn"] = "jax.experimental.rnn.lstm (cuDNN) takes fp32 only"
    else:
      fns["cudnn"] = lambda x, h_0, c_0, w: cudnn(x, h_0, c_0, w, seq_lengths, *shape)[0]
  elif op == "gru":
    fns = {"ours": lambda x, h_0, w: jax_dnn.gru(x, h_0, w, seq_lengths, *shape)[0],
           "cudnn": "jax.experimental.rnn has LSTM only"}
  else:
    fns = {"ours": lambda x, h_0, w: jax_dnn.rnn(x, h_0, w, seq_lengths, *shape,
                                                 nonlinearity="tanh")[0],
           "cudnn": "jax.experimental.rnn has LSTM only"}
  fns["scan"] = scan
  return fns


def tolerance(dtype) -> float:
  """harness.tolerance, but 1e-2 for fp32: both sides' recurrent matmuls run
  TF32 (10 mantissa bits, JAX's default precision on GPUs), whose rounding a
  sequence of steps carries forward."""
  return 1e-2 if jnp.dtype(dtype) == jnp.float32 else harness.tolerance(dtype)


def workload(case: harness.Case, settings: harness.Settings) -> harness.Workload:
  del settings  # one input set: every call runs T dependent steps, far beyond its dispatch
  batch, steps, hidden = case.shape
  layers, bidirectional = case.option("layers"), case.option("bidirectional")
  dirs = 2 if bidirectional else 1
  dtype = jnp.dtype(case.dtype)
  kx, kh, kc, kw, kdy = jax.random.split(jax.random.key(0), 5)
  init = {"lstm": jax_dnn.init_lstm_weight, "gru": jax_dnn.init_gru_weight,
          "rnn_tanh": jax_dnn.init_rnn_weight}[case.op]
  x = jax.random.normal(kx, (batch, steps, hidden), jnp.float32).astype(dtype)
  state = (layers * dirs, batch, hidden)
  h_0 = (0.5 * jax.random.normal(kh, state, jnp.float32)).astype(dtype)
  weights = init(kw, hidden, hidden, layers, bidirectional)
  args = (x, h_0, (0.5 * jax.random.normal(kc, state, jnp.float32)).astype(dtype), weights)
  if case.op != "lstm":
    args = (x, h_0, weights)
  dy = jax.random.normal(kdy, (batch, steps, dirs * hidden), jnp.float32).astype(dtype)
  return harness.Workload(fns=functions(case, lengths(case)), args=[args], cotangents=[dy],
                          work={}, tolerance=tolerance(dtype))


def annotate(row: dict) -> dict:
  """us a time step: the time over T."""
  return {"us_step": row["ms"] * 1e3 / row["shape"][1] if row["ms"] else None}


def plot_point(row: dict):
  """Panel per mode; x = the network's place in the sweep, fp32 dashed."""
  index = _INDEX.get(row["case"].rsplit(" ", 1)[0])
  if index is None:
    return None
  return row["mode"], index, "" if row["dtype"] == "bfloat16" else _SHORT[row["dtype"]]


_INDEX = {label: i for i, label in enumerate(dict.fromkeys(
    c.label.rsplit(" ", 1)[0] for c in all_cases()))}

FAMILY = harness.Family(
    name="rnn", unit="ms", ceiling=None, impls=("ours", "cudnn", "scan"), reference=("scan",),
    cases=cases, workload=workload, plot_point=plot_point,
    plot_x="network, in the table's order", annotate=annotate,
    columns=tuple((f"{impl} us/step", impl, "us_step", ".2f")
                  for impl in ("ours", "cudnn", "scan")))
