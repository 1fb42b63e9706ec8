"""A tiny stand-in for an examples/train_*.py program, following the
examples' contract (make_step, SIZES), for tests of the models benchmark:
a next-token model (embedding, layer norm, bias + GELU, a projection to the
vocabulary) with jax_dnn's layer_norm and bias_act as backend "jax_dnn" and
their jnp equivalents as backend "xla"; plain SGD."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import jax_dnn

SIZES = {"tiny": dict(batch=4, steps=8, vocab=16, width=32),
         "small": dict(batch=8, steps=8, vocab=16, width=32),
         "realistic": dict(batch=8, steps=16, vocab=32, width=64)}


def _forward(backend, params, tokens, dtype):
  h = params["embed"][tokens].astype(dtype)
  if backend == "jax_dnn":
    h = jax_dnn.layer_norm(h, params["scale"].astype(dtype), params["shift"].astype(dtype))
    h = jax_dnn.bias_act(h @ params["w"].astype(dtype), params["b"].astype(dtype), "gelu")
  else:
    mean = jnp.mean(h.astype(jnp.float32), -1, keepdims=True)
    var = jnp.var(h.astype(jnp.float32), -1, keepdims=True)
    h = ((h - mean) * jax.lax.rsqrt(var + 1e-6) * params["scale"] + params["shift"]).astype(dtype)
    h = jax.nn.gelu(h @ params["w"].astype(dtype) + params["b"].astype(dtype), approximate=False)
  return (h @ params["out"].astype(dtype)).astype(jnp.float32)


def make_step(backend: str, size: str = "tiny", *, global_batch: int | None = None,
              mesh=None, seed: int = 0, dtype: str = "bfloat16", **overrides):
  if backend not in ("jax_dnn", "xla"):
    raise ValueError(f"backend must be 'jax_dnn' or 'xla'; got {backend!r}")
  cfg = dict(SIZES[size], **overrides)
  batch_rows = global_batch or cfg["batch"]
  v, d = cfg["vocab"], cfg["width"]
  rng = np.random.default_rng(seed)  # numpy: no compilation before the step's own
  normal = lambda *shape: rng.standard_normal(shape, np.float32)  # noqa: E731
  params = {"embed": normal(v, d), "scale": np.ones((d,), np.float32),
            "shift": np.zeros((d,), np.float32), "w": normal(d, d) / d**0.5,
            "b": np.zeros((d,), np.float32), "out": normal(d, v) / d**0.5}
  batch = {"tokens": rng.integers(0, v, (batch_rows, cfg["steps"] + 1), dtype=np.int32)}
  state = {"params": params, "step": np.zeros((), np.int32)}
  if mesh is not None:
    batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data")))
    state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))
  else:
    batch, state = jax.device_put(batch), jax.device_put(state)

  def loss_fn(p, batch):
    logits = _forward(backend, p, batch["tokens"][:, :-1], jnp.dtype(dtype))
    labels = jax.nn.one_hot(batch["tokens"][:, 1:], v)
    return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), -1))

  def step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
    params = jax.tree.map(lambda p, g: p - 0.5 * g, state["params"], grads)
    return {"params": params, "step": state["step"] + 1}, loss

  return jax.jit(step, donate_argnums=0), state, batch


def main(argv=None) -> float:
  step, state, batch = make_step("jax_dnn")
  for _ in range(5):
    state, loss = step(state, batch)
  return float(loss)


if __name__ == "__main__":
  print(main())
