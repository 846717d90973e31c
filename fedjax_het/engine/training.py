"""Local SGD for one client: drop_last batches of its real rows, in stored order or reshuffled, masked padding steps.

One epoch over n real rows is n // batch_size steps, like a PyTorch `DataLoader(drop_last=True)`:
  order='stored' (HtFLlib, `shuffle=False`): rows 0 .. B*floor(n/B)-1 in the client's stored order every epoch;
    the last n mod B rows are never used, in training nor in statistics passes over the train loader
    (`statistics_rows`);
  order='shuffle' (PFLlib, `shuffle=True`): a fresh permutation every epoch. Statistics passes then use all n rows
    (PFLlib's shuffled loader would drop a random n mod B of them each pass; we do not draw that subset).
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


DATA_ORDERS = ('stored', 'shuffle')


@dataclasses.dataclass(frozen=True)
class LocalTraining:
  """Local optimisation settings: plain SGD, a fresh optimizer each round (HtFLlib), `epochs` local epochs, and
  the order local batches take the rows in ('stored': HtFLlib; 'shuffle': PFLlib)."""
  learning_rate: float = 0.01
  batch_size: int = 32
  epochs: int = 1
  order: str = 'stored'

  def __post_init__(self):
    if self.order not in DATA_ORDERS:
      raise ConfigError(f'--data_order={self.order!r} is unknown; choose one of {", ".join(DATA_ORDERS)} '
                        f'(stored: HtFLlib, shuffle: PFLlib).')
    if self.batch_size < 1:
      raise ConfigError(f'--batch_size={self.batch_size} must be >= 1.')
    if self.epochs < 0:
      raise ConfigError(f'--local_epochs={self.epochs} must be >= 0.')
    if self.learning_rate <= 0:
      raise ConfigError(f'--local_learning_rate={self.learning_rate} must be > 0.')

  def optimizer(self) -> optax.GradientTransformation:
    """optax.sgd(learning_rate): plain SGD without momentum."""
    return optax.sgd(self.learning_rate)

  def statistics_rows(self, n: jnp.ndarray) -> jnp.ndarray:
    """How many of a client's n training rows (its first ones, in stored order) a statistics pass over the train
    loader sees: B*floor(n/B) under HtFLlib's stored order (drop_last), all n under 'shuffle'. A client with
    fewer rows than one batch, whose loader yields nothing, keeps all n so that its upload stays defined."""
    if self.order == 'shuffle':
      return n
    used = n // self.batch_size * self.batch_size
    return jnp.where(used > 0, used, n)


def batch_schedule(rng: jax.Array, n: jnp.ndarray, n_max: int, batch_size: int, epochs: int, order: str = 'stored'
                   ) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Row indices [epochs * S, batch_size] and validity [epochs * S] for S = n_max // batch_size step slots.

  order 'stored': every epoch takes rows 0, 1, ... in order; 'shuffle': each epoch draws a fresh permutation of
  the client's n real rows (padding rows sort last and are never used). Step s of an epoch is valid iff
  s < n // batch_size.
  """
  slots = n_max // batch_size
  rows = jnp.arange(n_max)

  def one_epoch(e):
    if order == 'stored':
      perm = rows[:slots * batch_size]
    else:
      perm = shuffled_real_rows(jax.random.fold_in(rng, e), rows < n)[:slots * batch_size]
    return perm.reshape(slots, batch_size), jnp.arange(slots) < n // batch_size

  idx, valid = jax.vmap(one_epoch)(jnp.arange(epochs))
  return idx.reshape(epochs * slots, batch_size), valid.reshape(epochs * slots)


LossFn = Callable[..., tuple[jnp.ndarray, Any]]


def sgd_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, carry: tuple, x: jnp.ndarray,
             y: jnp.ndarray, valid: jnp.ndarray, rng: jax.Array) -> tuple[tuple, jnp.ndarray]:
  """One masked SGD step on a batch: carry = (params, model_state, opt_state[, statistics]); returns (carry, loss).

  loss_fn(params, model_state, x, y, rng) -> (loss, new_model_state), or, when the carry has a fourth entry,
  (loss, (new_model_state, batch_statistics)) whose statistics (a pytree of per-batch sums) are added to it:
  quantities gathered in the training passes, as HtFLlib's FedProto and FD gather theirs. An invalid step
  returns the carry unchanged and a loss of 0.
  """
  params, model_state, opt_state = carry[:3]
  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, model_state, x, y, rng)
  updates, new_opt_state = optimizer.update(grads, opt_state, params)
  new = (optax.apply_updates(params, updates), aux, new_opt_state)
  if len(carry) == 4:
    new_model_state, batch_statistics = aux
    new = (new[0], new_model_state, new_opt_state, jax.tree.map(jnp.add, carry[3], batch_statistics))
  keep = lambda a, b: jnp.where(valid, a, b)
  return jax.tree.map(keep, new, carry), jnp.where(valid, loss, 0.0)


def initial_carry(loss_fn: LossFn, optimizer: optax.GradientTransformation, params: Any, model_state: Any,
                  x: jnp.ndarray, y: jnp.ndarray, batch_size: int, statistics: bool) -> tuple:
  """The carry of `sgd_step` before the first local step: (params, model_state, a fresh optimizer state), plus
  zero statistics shaped like those `loss_fn` returns when `statistics`."""
  carry = (params, model_state, optimizer.init(params))
  if not statistics:
    return carry
  batch_shapes = jax.eval_shape(loss_fn, params, model_state, x[:batch_size], y[:batch_size],
                                jax.random.PRNGKey(0))[1][1]
  return carry + (jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), batch_shapes),)


def step_key(rng: jax.Array, epoch, step) -> jax.Array:
  """The key of local step `step` of epoch `epoch` (independent of how many padded step slots exist)."""
  return jax.random.fold_in(jax.random.fold_in(rng, epoch + 1), step)


def train_scan(loss_fn: LossFn, training: LocalTraining, params: Any, model_state: Any, x: jnp.ndarray,
               y: jnp.ndarray, n: jnp.ndarray, rng: jax.Array, unroll: int | bool = 1, statistics: bool = False
               ) -> tuple[Any, Any, jnp.ndarray, Any]:
  """All local epochs of one client as one lax.scan; returns (params, model_state, mean loss of real steps,
  training-pass statistics summed over the real steps (None unless `statistics`, see `sgd_step`)).

  `unroll` is lax.scan's: steps per loop iteration (True: no loop), trading compile time for loop overhead.
  """
  optimizer = training.optimizer()
  idx, valid = batch_schedule(jax.random.fold_in(rng, 0), n, x.shape[0], training.batch_size, training.epochs,
                              training.order)
  slots = x.shape[0] // training.batch_size

  def body(carry, step):
    s, batch, ok = step
    key = step_key(rng, s // max(slots, 1), s % max(slots, 1))
    return sgd_step(loss_fn, optimizer, carry, x[batch], y[batch], ok, key)

  steps = (jnp.arange(valid.shape[0]), idx, valid)
  carry = initial_carry(loss_fn, optimizer, params, model_state, x, y, training.batch_size, statistics)
  carry, losses = jax.lax.scan(body, carry, steps, unroll=unroll)
  stats = carry[3] if statistics else None
  return carry[0], carry[1], losses.sum() / jnp.maximum(valid.sum(), 1), stats
