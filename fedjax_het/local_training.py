"""The local schedule of one client: drop_last batches of its real rows, in stored order or reshuffled, masked
padding steps.

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
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_het.rows import shuffled_real_rows
from fedjax_het.errors import ConfigError


DATA_ORDERS = ('stored', 'shuffle')


@dataclasses.dataclass(frozen=True)
class LocalTraining:
  """Local optimisation settings: plain SGD, a fresh optimizer each round (HtFLlib), `epochs` local epochs, and
  the order local batches take the rows in ('stored': HtFLlib; 'shuffle': PFLlib).

  rows: None, the schedule runs over the client's own training rows; an int R, over R rows the program generates
  itself (e.g. FedVTC's fine-tuning on S*C decoded latents): every client then takes epochs * (R // batch_size)
  steps, whatever its data, and each step's `Batch` holds only the row ids (`Batch.index`).
  max_steps: None, every step of the epochs; an int, at most that many steps per stage of a round, the first ones
  of its schedule (--local_steps; Felo's code trains 10 steps of batch 50 per round).
  """
  learning_rate: float = 0.01
  batch_size: int = 32
  epochs: int = 1
  order: str = 'stored'
  rows: Optional[int] = None
  max_steps: Optional[int] = None

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
    if self.max_steps is not None and self.max_steps < 1:
      raise ConfigError(f'--local_steps={self.max_steps} must be >= 0 (0: whole --local_epochs epochs).')
    if self.rows is not None and self.rows < self.batch_size:
      raise ConfigError(f'generated rows per client ({self.rows}) must be at least one batch ({self.batch_size}).')

  def steps_per_epoch(self, n) -> int:
    """Local steps per epoch of a client with n training rows (drop_last; the generated rows when `rows` is set)."""
    return (self.rows if self.rows is not None else n) // self.batch_size

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


def cap_schedule(idx: jnp.ndarray, valid: jnp.ndarray, max_steps: Optional[int], epochs: int
                 ) -> tuple[jnp.ndarray, jnp.ndarray]:
  """A stage's schedule (`batch_schedule`) with only its first `max_steps` valid steps kept valid (None: all). A
  one-epoch schedule is also cut to its first max_steps slots (a client's valid slots come first there), so a
  scan over it runs no more steps than the cap."""
  if max_steps is None:
    return idx, valid
  valid = valid & (jnp.cumsum(valid) <= max_steps)
  if epochs == 1:
    return idx[:max_steps], valid[:max_steps]
  return idx, valid


def capped_steps(steps, max_steps: Optional[int]):
  """Steps a client takes in a stage of `steps` scheduled steps (numpy) under the cap `max_steps`."""
  return steps if max_steps is None else np.minimum(steps, max_steps)


def step_key(rng: jax.Array, epoch, step) -> jax.Array:
  """The key of local step `step` of epoch `epoch` (independent of how many padded step slots exist)."""
  return jax.random.fold_in(jax.random.fold_in(rng, epoch + 1), step)
