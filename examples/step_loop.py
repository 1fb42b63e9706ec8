"""The examples' training loop (train_cnn.train_loop, text_training.train):
steps dispatched one ahead of the loss read, so the device never waits for
the host."""

from __future__ import annotations

import time


def run_steps(step, state, next_batch, steps: int, *, report=None, after_step=None):
  """Runs `steps` steps of `state, loss = step(state, batch)` on batches from
  `next_batch()`, keeping one step queued behind the one whose loss is read:
  the next batch is drawn and placed while the step before runs.

  `after_step(i, state)` right after step i is dispatched, before the next
  step takes over (donates) its state; `report(i, loss, seconds)` once step
  i is done, seconds since the step before's completion (step 0: since the
  loop began, its compile included). Returns (state, every step's loss, the
  mean wall time of a step after the first in seconds, data included: what
  a run of many steps takes; nan for one step)."""
  losses, done = [], []

  def finish(i, loss):
    losses.append(float(loss))  # waits for step i
    done.append(time.perf_counter())
    if report is not None:
      report(i, losses[-1], done[-1] - (done[-2] if i > 0 else start))

  batch, pending = next_batch(), None
  start = time.perf_counter()
  for i in range(steps):
    state, loss = step(state, batch)
    if after_step is not None:
      after_step(i, state)
    if i + 1 < steps:
      batch = next_batch()
    if pending is not None:
      finish(*pending)
    pending = (i, loss)
  if pending is not None:
    finish(*pending)
  step_s = (done[-1] - done[0]) / (steps - 1) if steps > 1 else float("nan")
  return state, losses, step_s
