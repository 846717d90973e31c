"""Local SGD for one client: per-epoch shuffles of its real rows, drop_last batches, masked padding steps.

One epoch over n real rows is n // batch_size steps, like a PyTorch DataLoader(shuffle=True, drop_last=True).
A group is padded to n_max rows, so the schedule has n_max // batch_size step slots per epoch; slots past a
client's own step count are marked invalid and leave its state unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from fedjax_het.engine.rows import shuffled_real_rows
from fedjax_het.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class LocalTraining:
  """Local optimisation settings: plain SGD, a fresh optimizer each round (HtFLlib), `epochs` local epochs."""
  learning_rate: float = 0.01
  batch_size: int = 32
  epochs: int = 1

  def __post_init__(self):
    if self.batch_size < 1:
      raise ConfigError(f'--batch_size={self.batch_size} must be >= 1.')
    if self.epochs < 0:
      raise ConfigError(f'--local_epochs={self.epochs} must be >= 0.')
    if self.learning_rate <= 0:
      raise ConfigError(f'--local_learning_rate={self.learning_rate} must be > 0.')

  def optimizer(self) -> optax.GradientTransformation:
    """optax.sgd(learning_rate): plain SGD without momentum."""
    return optax.sgd(self.learning_rate)


def batch_schedule(rng: jax.Array, n: jnp.ndarray, n_max: int, batch_size: int, epochs: int
                   ) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Row indices [epochs * S, batch_size] and validity [epochs * S] for S = n_max // batch_size step slots.

  Each epoch draws a fresh permutation of the client's n real rows (padding rows sort last and are never used);
  step s of an epoch is valid iff s < n // batch_size.
  """
  slots = n_max // batch_size
  rows = jnp.arange(n_max)

  def one_epoch(e):
    perm = shuffled_real_rows(jax.random.fold_in(rng, e), rows < n)[:slots * batch_size]
    return perm.reshape(slots, batch_size), jnp.arange(slots) < n // batch_size

  idx, valid = jax.vmap(one_epoch)(jnp.arange(epochs))
  return idx.reshape(epochs * slots, batch_size), valid.reshape(epochs * slots)


LossFn = Callable[..., tuple[jnp.ndarray, Any]]


def sgd_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, carry: tuple, x: jnp.ndarray,
             y: jnp.ndarray, valid: jnp.ndarray, rng: jax.Array) -> tuple[tuple, jnp.ndarray]:
  """One masked SGD step on a batch: carry = (params, model_state, opt_state); returns (carry, loss).

  loss_fn(params, model_state, x, y, rng) -> (loss, new_model_state). An invalid step returns the carry
  unchanged and a loss of 0.
  """
  params, model_state, opt_state = carry
  (loss, new_model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, model_state, x, y, rng)
  updates, new_opt_state = optimizer.update(grads, opt_state, params)
  new = (optax.apply_updates(params, updates), new_model_state, new_opt_state)
  keep = lambda a, b: jnp.where(valid, a, b)
  return jax.tree.map(keep, new, carry), jnp.where(valid, loss, 0.0)


def step_key(rng: jax.Array, epoch, step) -> jax.Array:
  """The key of local step `step` of epoch `epoch` (independent of how many padded step slots exist)."""
  return jax.random.fold_in(jax.random.fold_in(rng, epoch + 1), step)


def train_scan(loss_fn: LossFn, training: LocalTraining, params: Any, model_state: Any, x: jnp.ndarray,
               y: jnp.ndarray, n: jnp.ndarray, rng: jax.Array, unroll: int | bool = 1
               ) -> tuple[Any, Any, jnp.ndarray]:
  """All local epochs of one client as one lax.scan; returns (params, model_state, mean loss of real steps).

  `unroll` is lax.scan's: steps per loop iteration (True: no loop), trading compile time for loop overhead.
  """
  optimizer = training.optimizer()
  idx, valid = batch_schedule(jax.random.fold_in(rng, 0), n, x.shape[0], training.batch_size, training.epochs)
  slots = x.shape[0] // training.batch_size

  def body(carry, step):
    s, batch, ok = step
    key = step_key(rng, s // max(slots, 1), s % max(slots, 1))
    return sgd_step(loss_fn, optimizer, carry, x[batch], y[batch], ok, key)

  steps = (jnp.arange(valid.shape[0]), idx, valid)
  (params, model_state, _), losses = jax.lax.scan(body, (params, model_state, optimizer.init(params)), steps,
                                                  unroll=unroll)
  return params, model_state, losses.sum() / jnp.maximum(valid.sum(), 1)
