"""Shared fixtures: every test that takes `device` runs once on the CPU (the
reference path) and once on a CUDA GPU (our kernels; marker `gpu`, skipped
visibly where no CUDA device is present). JAX gets 8 CPU devices, for
test_sharding.py."""

import os

# Under pytest-xdist (`-n auto`) several processes share a GPU: none takes
# XLA's default 75% of its memory up front.
if os.environ.get("PYTEST_XDIST_WORKER"):
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

# test_sharding.py splits ops over a mesh of 8 host devices. Set before any
# backend starts; elsewhere the default device stays the first one.
jax.config.update("jax_num_cpu_devices", 8)

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

from helpers import every_nth, require_kernels


def _gpu_device():
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    return None
  return devices[0] if devices else None


def _use_gpu(why):
  """The CUDA device, after checking jax_dnn has its kernels; skips without one."""
  dev = _gpu_device()
  if dev is None:
    pytest.skip(f"no CUDA device: {why}")
  require_kernels()
  return dev


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def device(request):
  if request.param == "cpu":
    dev = jax.devices("cpu")[0]
  else:
    dev = _use_gpu("the GPU (kernel) variant of this test needs one")
  with jax.default_device(dev):
    yield dev


@pytest.fixture
def gpu():
  """The CUDA device, for GPU-only tests (mark them `gpu`)."""
  dev = _use_gpu("this test runs our kernels and needs one")
  with jax.default_device(dev):
    yield dev


# --every N (default 3): of each test function's CPU cases (its
# parametrizations, in collection order), the first and every N-th after it;
# every function runs, and the GPU cases (skipped without a GPU) all stay.
# The CPU cases run the reference path, one code for every shape and dtype
# the kernels' variants need: on 2 cores all of them take about an hour,
# a third about twenty minutes. --every 1 runs them all. --every-offset K
# takes the cases whose index is K modulo N instead: CI's second pass (jax
# 0.11, .ci/run) runs cases the first did not.


def pytest_addoption(parser):
  parser.addoption("--every", type=int, default=3, metavar="N",
                   help="run the first and every N-th CPU case of each test function "
                        "(default 3; 1: all); GPU cases all run")
  parser.addoption("--every-offset", type=int, default=0, metavar="K",
                   help="with --every N: the cases whose index is K modulo N")


def pytest_collection_modifyitems(config, items):
  every = config.getoption("--every")
  if every <= 1:
    return
  keep, drop = every_nth(items, every, config.getoption("--every-offset"))
  if drop:
    config.hook.pytest_deselected(items=drop)
    items[:] = keep
