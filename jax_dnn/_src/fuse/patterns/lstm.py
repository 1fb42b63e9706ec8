"""An LSTM cell inside lax.scan (flax.nnx.RNN over LSTMCell or
OptimizedLSTMCell, or a hand-written scan over either) -> the recurrence
kernels: the input projection of every step as one matmul before them.

The scan's body must be one LSTM step: its carry (c, h) [B, H] (either
order), one scanned input x_t [B, I], ys = h_t. Each gate's preactivation
is read as an affine function of x_t and h (dot_generals with weights the
scan closes over, bias adds, and the splits or slices that cut a fused
[B, 4H] projection into gates); which gate is which is decided by
evaluating the body on random values against the kernels' step for each
assignment of the sigmoid gates to i, f, o (the tanh one is g). Anything
else in the body (a projection of h, peepholes, dropout) fails that check
and leaves the scan to XLA."""

from __future__ import annotations

import itertools
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core

from jax_dnn._src import checks
from jax_dnn._src.fuse import graph as graph_lib
from jax_dnn._src.fuse.patterns import Match, NearMiss

_PASS = ("convert_element_type",)
_STRIP = ("reshape", "broadcast_in_dim", "convert_element_type")


def scan_counts(params):
  """(consts, carry) operand counts of a scan (jax 0.10: num_consts and
  num_carry; 0.11: the sizes of the first two groups of its flat tree
  ft_in)."""
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(list(consts.vals)), len(list(carry.vals))


def _terms(g, v, roles, depth=0):
  """v as a sum of terms (role, weight or bias variable, lo, hi): x_t @ W[:, lo:hi],
  h @ W[:, lo:hi] or b[lo:hi], roles mapping the body's x_t, h and weight
  invars to "x", "h" and "w". None where v is no such sum."""
  if depth > 16:
    return None
  hit = g.eqn_of(v)
  if hit is None:
    return None
  i, eqn = hit
  name = eqn.primitive.name
  width = v.aval.shape[-1] if v.aval.ndim else 0
  if name == "convert_element_type":
    return _terms(g, eqn.invars[0], roles, depth + 1)
  if name == "add":
    parts = [_terms(g, a, roles, depth + 1) for a in eqn.invars]
    return None if any(p is None for p in parts) else parts[0] + parts[1]
  if name in ("split", "slice"):
    src = eqn.invars[0]
    last = src.aval.ndim - 1
    if name == "split":
      if eqn.params["axis"] % src.aval.ndim != last:
        return None
      k = eqn.outvars.index(v)
      lo = int(sum(eqn.params["sizes"][:k]))
    else:
      starts, limits = eqn.params["start_indices"], eqn.params["limit_indices"]
      if eqn.params.get("strides") not in (None, (1,) * src.aval.ndim) or any(
          s != 0 or l != d for s, l, d in zip(starts[:-1], limits[:-1], src.aval.shape[:-1])):
        return None
      lo = int(starts[-1])
    inner = _terms(g, src, roles, depth + 1)
    return None if inner is None else [(r, w, a + lo, a + lo + width) for r, w, a, _ in inner]
  if name == "dot_general":
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, _ = g.through(eqn.invars[0], *_PASS)
    rhs, _ = g.through(eqn.invars[1], *_PASS)
    if (tuple(lc), tuple(rc), tuple(lb), tuple(rb)) != ((1,), (0,), (), ()):
      return None
    if roles.get(lhs) not in ("x", "h") or roles.get(rhs) != "w" or rhs.aval.ndim != 2:
      return None
    return [(roles[lhs], rhs, 0, width)]
  if name in ("reshape", "broadcast_in_dim"):
    b, _ = g.through(v, *_STRIP)
    if roles.get(b) == "w" and b.aval.ndim == 1 and b.aval.shape[0] == width:
      return [("b", b, 0, width)]
  return None


def _gates(g, roles, hidden):
  """The four gate preactivations: [(nonlinearity, terms)] in body order."""
  found = []
  for eqn in g.eqns:
    if eqn.primitive.name in ("logistic", "tanh") and eqn.invars[0].aval.shape[-1:] == (hidden,):
      terms = _terms(g, eqn.invars[0], roles)
      if terms and any(t[0] in ("x", "h") for t in terms):
        found.append((eqn.primitive.name, terms))
  return found


def _block(terms, role, values, rows, hidden, dtype):
  """The sum of a gate's `role` terms: a [rows, H] weight block (or [H] bias)."""
  out = jnp.zeros((rows, hidden) if role != "b" else (hidden,), dtype)
  for r, w, lo, hi in terms:
    if r == role:
      out = out + (values[w][:, lo:hi] if role != "b" else values[w][lo:hi]).astype(dtype)
  return out


def _assemble(gates, order, values, inputs, hidden, dtype):
  """W_i [I, 4H], W_h [H, 4H], b [4H] in the kernels' gate order (i, f, g, o)."""
  ordered = [gates[k][1] for k in order]
  wi = jnp.concatenate([_block(t, "x", values, inputs, hidden, dtype) for t in ordered], 1)
  wh = jnp.concatenate([_block(t, "h", values, hidden, hidden, dtype) for t in ordered], 1)
  b = jnp.concatenate([_block(t, "b", values, 0, hidden, dtype) for t in ordered])
  return wi, wh, b


def _step(wi, wh, b, x, h, c):
  z = x @ wi + h @ wh + b
  zi, zf, zg, zo = jnp.split(z, 4, axis=-1)
  c = jax.nn.sigmoid(zf) * c + jax.nn.sigmoid(zi) * jnp.tanh(zg)
  return jax.nn.sigmoid(zo) * jnp.tanh(c), c


def _order(body, gates, roles_out, x, h, c, hidden, dtype):
  """The assignment of the body's gates to (i, f, g, o) under which the
  body computes the kernels' step (on random values), or None."""
  tanh = [k for k, (nl, _) in enumerate(gates) if nl == "tanh"]
  if len(gates) != 4 or len(tanh) != 1:
    return None
  rng = np.random.default_rng(0)
  tol = 2e-3 if jnp.dtype(dtype).itemsize == 4 else 5e-2
  vals = [(0.5 * rng.standard_normal(v.aval.shape)).astype(v.aval.dtype) for v in body.invars]
  with jax.ensure_compile_time_eval():
    outs = [np.asarray(o, np.float32) for o in core.jaxpr_as_fun(
        core.ClosedJaxpr(body, ()))(*vals)]
    values = {v: np.asarray(a, np.float32) for v, a in zip(body.invars, vals)}
    sigmoid = [k for k in range(4) if k != tanh[0]]
    for i, f, o in itertools.permutations(sigmoid):
      order = (i, f, tanh[0], o)
      wi, wh, b = _assemble(gates, order, values, values[x].shape[-1], hidden, jnp.float32)
      h1, c1 = _step(wi, wh, b, values[x], values[h], values[c])
      want = {h: np.asarray(h1), c: np.asarray(c1)}
      if all(np.allclose(o, want[r], rtol=tol, atol=tol) for o, r in zip(outs, roles_out)):
        return order
  return None


def _gate_dtype(g, hidden):
  for eqn in g.eqns:
    if eqn.primitive.name in ("logistic", "tanh") and eqn.invars[0].aval.shape[-1:] == (hidden,):
      return eqn.invars[0].aval.dtype
  return None


def _match(graph, i):
  from jax_dnn._src.rnn import recurrence as rec  # pylint: disable=g-import-not-at-top
  eqn = graph.eqns[i]
  p = eqn.params
  n_consts, n_carry = scan_counts(p)
  closed = p["jaxpr"]
  closed = closed if hasattr(closed, "consts") else core.ClosedJaxpr(closed, ())
  if n_carry != 2 or len(eqn.invars) != n_consts + 3 or len(eqn.outvars) != 3:
    return None
  body = graph_lib.flatten(closed).jaxpr
  if body.constvars:
    return None
  consts, (k0, k1), x = body.invars[:n_consts], body.invars[n_consts:n_consts + 2], \
      body.invars[-1]
  if x.aval.ndim != 2 or k0.aval.ndim != 2 or k0.aval.shape != k1.aval.shape:
    return None
  hidden = k0.aval.shape[-1]
  g = graph_lib.Graph(body, {})
  for h, c in ((k1, k0), (k0, k1)):
    roles = {x: "x", h: "h", **{w: "w" for w in consts}}
    gates = _gates(g, roles, hidden)
    if len(gates) == 4:
      break
  else:
    return None
  # The gates' dtype is the step's (Flax's bf16 cell keeps c and h in
  # float32 between its bf16 gate computations): the kernels run in it,
  # their results converted to the scan's.
  dtype = _gate_dtype(g, hidden)
  if not checks.kernel_dtype(dtype):
    return NearMiss("lstm", i, f"an LSTM step computed in {dtype}; the kernels take float32, "
                    "bfloat16 and float16")
  # Body outputs: the carry (c, h in the carry's order) and ys = h.
  order = _order(body, gates, [c if k is c else h for k in (k0, k1)] + [h], x, h, c, hidden,
                 dtype)
  if order is None:
    return NearMiss("lstm", i, "a scan with four gates that is not an LSTM step (h_t, c_t, ys)")
  c_first = c is k0
  reverse = bool(p["reverse"])
  const_pos = {w: j for j, w in enumerate(consts)}
  inputs_dim = x.aval.shape[-1]

  out_dtypes = [v.aval.dtype for v in eqn.outvars]

  def replace(*vals):
    xs, carry = vals[-1].astype(dtype), vals[n_consts:n_consts + 2]
    c0, h0 = (carry[0], carry[1]) if c_first else (carry[1], carry[0])
    values = {w: vals[j] for w, j in const_pos.items()}
    wi, wh, b = _assemble(gates, order, values, inputs_dim, hidden, dtype)
    gx = jnp.einsum("tbi,ig->tbg", xs, wi) + b
    lengths = jnp.full((xs.shape[1],), xs.shape[0], jnp.int32)
    y, h_n, c_n = rec.recurrence(gx, wh.T, jnp.zeros_like(b), h0.astype(dtype),
                                 c0.astype(dtype), lengths, kind=rec.LSTM, reverse=reverse)
    outs = [c_n, h_n, y] if c_first else [h_n, c_n, y]
    return [o.astype(d) for o, d in zip(outs, out_dtypes)]
  return Match("lstm", frozenset([i]), tuple(eqn.invars), None, replace,
               f"jax_dnn recurrence (LSTM, H={hidden}{', reverse' if reverse else ''})",
               outputs=tuple(eqn.outvars))


LSTM = types.SimpleNamespace(NAME="lstm", ANCHORS=("scan",), match=_match)
