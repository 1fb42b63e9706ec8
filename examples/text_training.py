"""The training machinery the two text examples (train_lstm_lm.py,
train_transformer.py) share: the optimizer, the data-parallel mesh and
shardings, the jitted step over (model, optimizer), the training loop with
its step time, and the validation loss. Each example keeps its model, loss
and batches.
"""

from __future__ import annotations

import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import step_loop  # the examples' folder is on sys.path (each example puts it there)


def data_mesh(global_batch: int):
  """(mesh or None, devices): data parallel over as many devices as split the
  batch evenly (all, for the sizes' batches on 1, 2, 4 or 8 GPUs)."""
  count = max(n for n in range(1, jax.device_count() + 1) if global_batch % n == 0)
  devices = jax.devices()[:count]
  return (jax.make_mesh((count,), ("data",), devices=devices) if count > 1 else None), devices


def shardings(mesh):
  """(replicated, batch-split) shardings over a 1-D "data" mesh. The mesh's
  axis is taken as Auto (jax.make_mesh's default is Explicit): the model code
  is plain, and XLA partitions it from the shardings of its inputs."""
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  mesh = jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                           axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
  return (jax.sharding.NamedSharding(mesh, P()), jax.sharding.NamedSharding(mesh, P("data")))


def placer(mesh):
  """A batch's placement (asynchronous): split over `mesh`'s "data" axis, or
  on the default device."""
  return jax.device_put if mesh is None else (lambda b: jax.device_put(b, shardings(mesh)[1]))


def embed_bytes(embed: nnx.Embed, tokens):
  """embed(tokens) for a byte vocabulary, as a one-hot matmul: its gradient
  is a matmul too, where the gather's is a scatter-add whose atomics collide
  on text's frequent bytes (LSTM LM realistic on an H100: the step took 37.6
  ms on the standard library's source, 17.4 ms on uniform random bytes).
  Values equal embed(tokens)'s: each output sums one product with 1."""
  table = embed.embedding[...]
  dtype = embed.dtype or table.dtype
  return jnp.dot(jax.nn.one_hot(tokens, table.shape[0], dtype=dtype), table.astype(dtype),
                 preferred_element_type=jnp.float32).astype(dtype)


def adamw_optimizer(model, learning_rate: float) -> nnx.Optimizer:
  """AdamW (weight decay 0.01) after clipping the gradients' global norm to
  1, over the model's parameters: both text models' optimizer."""
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(learning_rate, weight_decay=0.01))
  return nnx.Optimizer(model, tx, wrt=nnx.Param)


def jit_step(model, optimizer, loss_fn, batch, mesh):
  """(graphdef, step, state, batch): `state, loss = step(state, batch)` one
  jitted training step of (model, optimizer) on `loss_fn(model, batch)`. Data
  parallel over `mesh`: the batch split, parameters and optimizer state
  replicated (XLA all-reduces the gradients)."""
  graphdef, state = nnx.split((model, optimizer))

  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  if mesh is None:
    return graphdef, jax.jit(step, donate_argnums=0), state, jax.tree.map(jnp.asarray, batch)
  replicated, split = shardings(mesh)
  state = jax.device_put(state, replicated)
  batch = jax.device_put(batch, split)
  state_sharding = jax.tree.map(lambda _: replicated, state)
  return (graphdef, jax.jit(step, donate_argnums=0, in_shardings=(state_sharding, split),
                            out_shardings=(state_sharding, replicated)), state, batch)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _eval_loss(loss_fn, graphdef, state, batch):
  model, _ = nnx.merge(graphdef, state)
  return loss_fn(model, batch)


def evaluate(loss_fn, graphdef, state, data, count: int, place=lambda b: b) -> float:
  """Mean loss over `count` batches of `data`, without training."""
  return float(np.mean([_eval_loss(loss_fn, graphdef, state, place(next(data)))
                        for _ in range(count)]))


def train(step, state, data, place, *, steps: int, log_every: int, every=None):
  """Runs `steps` steps on batches of `data` (step_loop.run_steps: the next
  batch placed while a step runs), printing the loss every `log_every` steps
  and the step time (wall time after the first step, which compiles);
  `every(i, state)` after each step where given. Returns (state, the mean
  loss of the last 10 steps)."""
  def report(i, loss, _):
    if i % log_every == 0 or i == steps - 1:
      print(f"step {i:5d}  loss {loss:.4f}")

  state, losses, step_s = step_loop.run_steps(step, state, lambda: place(next(data)), steps,
                                              report=report, after_step=every)
  if steps > 1:
    print(f"step time {step_s * 1e3:.2f} ms ({steps - 1} steps after the first)")
  last = min(10, len(losses))
  final = float(np.mean(losses[-last:]))
  print(f"final loss (mean of the last {last} steps) {final:.4f}")
  return state, final
