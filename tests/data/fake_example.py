"""A tiny stand-in for an examples/train_*.py program, following the
examples' contract (make_step, SIZES), for tests of the models benchmark:
a next-token model (embedding, layer norm, bias + GELU, a projection to the
vocabulary) with jax_dnn's layer_norm and bias_act as backend "jax_dnn" and
their jnp equivalents as backend "xla"; plain SGD."""

from __future__ import annotations

import jax
import jax.numpy as jnp
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
  ke, kw, ko, kt = jax.random.split(jax.random.key(seed), 4)
  params = {"embed": jax.random.normal(ke, (v, d)), "scale": jnp.ones((d,)),
            "shift": jnp.zeros((d,)), "w": jax.random.normal(kw, (d, d)) / d**0.5,
            "b": jnp.zeros((d,)), "out": jax.random.normal(ko, (d, v)) / d**0.5}
  tokens = jax.random.randint(kt, (batch_rows, cfg["steps"] + 1), 0, v, jnp.int32)
  batch = {"tokens": tokens}
  state = {"params": params, "step": jnp.zeros((), jnp.int32)}
  if mesh is not None:
    batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data")))
    state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))

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
