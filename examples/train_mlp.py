"""Trains a small Flax NNX classifier built on jax_dnn's ops and prints a
falling loss. Runs on CPU (reference path) or GPU (jax_dnn's kernels).

    pip install ".[examples]"
    python examples/train_mlp.py

The model: Linear -> fused bias + GELU (jax_dnn.bias_act) -> jax_dnn.nn.LayerNorm
-> Linear -> jax_dnn.nn.RMSNorm -> Linear, trained with a log_softmax
cross-entropy (jax_dnn.log_softmax) on a synthetic task: which of 8 random
prototypes a noisy point came from.
"""

import argparse

from flax import nnx
import jax
import jax.numpy as jnp
import optax

import jax_dnn
import jax_dnn.nn


class Block(nnx.Module):
  """Linear without bias, then jax_dnn's fused bias + activation."""

  def __init__(self, din, dout, *, rngs):
    self.linear = nnx.Linear(din, dout, use_bias=False, rngs=rngs)
    self.bias = nnx.Param(jnp.zeros((dout,)))

  def __call__(self, x):
    return jax_dnn.bias_act(self.linear(x), self.bias[...], activation="gelu_tanh")


class Classifier(nnx.Module):

  def __init__(self, din, hidden, classes, *, rngs):
    self.block1 = Block(din, hidden, rngs=rngs)
    self.norm1 = jax_dnn.nn.LayerNorm(hidden, rngs=rngs)
    self.block2 = Block(hidden, hidden, rngs=rngs)
    self.norm2 = jax_dnn.nn.RMSNorm(hidden, rngs=rngs)
    self.head = nnx.Linear(hidden, classes, rngs=rngs)

  def __call__(self, x):
    x = self.norm1(self.block1(x))
    x = self.norm2(self.block2(x))
    return self.head(x)


def make_data(key, n, din, classes):
  kp, kc, kn = jax.random.split(key, 3)
  prototypes = jax.random.normal(kp, (classes, din))
  labels = jax.random.randint(kc, (n,), 0, classes)
  x = prototypes[labels] + 3.0 * jax.random.normal(kn, (n, din))
  return x, labels


def loss_fn(model, x, labels):
  logp = jax_dnn.log_softmax(model(x))
  return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


@nnx.jit
def train_step(model, optimizer, x, labels):
  loss, grads = nnx.value_and_grad(loss_fn)(model, x, labels)
  optimizer.update(model, grads)
  return loss


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=200)
  ap.add_argument("--batch", type=int, default=256)
  args = ap.parse_args()

  din, hidden, classes = 32, 128, 8
  x_all, y_all = make_data(jax.random.key(0), 8192, din, classes)
  model = Classifier(din, hidden, classes, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  print(f"devices: {jax.devices()}; jax_dnn kernels built: {jax_dnn.has_cuda_kernels()}")
  for step in range(args.steps):
    i = (step * args.batch) % (x_all.shape[0] - args.batch)
    loss = train_step(model, optimizer, x_all[i:i + args.batch], y_all[i:i + args.batch])
    if step % 20 == 0 or step == args.steps - 1:
      print(f"step {step:4d}  loss {float(loss):.4f}")


if __name__ == "__main__":
  main()
