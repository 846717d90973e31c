"""The local schedule of one client: batches of its real rows, in stored order or reshuffled, with or without
the last partial batch, masked padding steps.

The batching rule is a property of each paper's setting (`drop_last`, --drop_last):
  drop_last=True (HtFLlib's `DataLoader(drop_last=True)`: FedRE and its baselines): an epoch over n real rows is
    n // batch_size full batches; the last n mod B rows are never used that epoch. Under order='stored' they are
    never used at all, in training nor in statistics passes over the train loader (`statistics_rows`).
  drop_last=False (PyTorch's default loader, which GeFL's code uses): ceil(n / batch_size) batches, the last one
    holding the n mod B remaining rows. It is padded to the full batch shape (one compiled step for every batch);
    `Batch.mask` marks its real rows, losses average over them and BatchNorm counts only them
    (`models.norm.batch_rows`), so a client of 60 rows and batch 64 takes one step on 60 rows, as PyTorch does.
  order='stored' (HtFLlib, `shuffle=False`): rows 0, 1, ... in the client's stored order every epoch;
  order='shuffle' (PFLlib, `shuffle=True`): a fresh permutation every epoch. Statistics passes then use all n rows
    (PFLlib's shuffled drop_last loader would drop a random n mod B of them each pass; we do not draw that subset).
A group is padded to n_max rows, so the schedule has as many step slots per epoch as a client of n_max rows
takes; slots past a client's own step count are marked invalid and leave its state unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import optax

from fedjax_het.data.augment import AUGMENTATIONS
from fedjax_het.errors import ConfigError
from fedjax_het.rows import shuffled_real_rows


DATA_ORDERS = ('stored', 'shuffle')


@dataclasses.dataclass(frozen=True)
class LocalTraining:
  """Local optimisation settings: plain SGD, a fresh optimizer each round (HtFLlib), `epochs` local epochs, the
  order local batches take the rows in ('stored': HtFLlib; 'shuffle': PFLlib), and whether an epoch drops the last
  partial batch (`drop_last`, HtFLlib's loader) or trains on it (PyTorch's default loader, GeFL's).

  rows: None, the schedule runs over the client's own training rows; an int R, over R rows the program generates
  itself (e.g. FedVTC's fine-tuning on S*C decoded latents): every client then takes epochs * (R // batch_size)
  steps, whatever its data, and each step's `Batch` holds only the row ids (`Batch.index`).
  max_steps: None, every step of the epochs; an int, at most that many steps per stage of a round, the first ones
  of its schedule (--local_steps; Felo's code trains 10 steps of batch 50 per round).
  augment: 'none', 'crop_flip': every local step's images randomly cropped with padding 4 and flipped
  (`data.augment`, the CIFAR references' loaders), or 'crop_flip_cutout': then a 16 x 16 Cutout (FedGKT's
  loader); augment_fill: the value of a black pixel in the run's
  normalisation, per channel or one for all (what the crop pads with).
  """
  learning_rate: float = 0.01
  batch_size: int = 32
  epochs: int = 1
  order: str = 'stored'
  rows: Optional[int] = None
  max_steps: Optional[int] = None
  drop_last: bool = True
  augment: str = 'none'
  augment_fill: tuple[float, ...] = (-1.0,)

  def __post_init__(self):
    if self.augment not in AUGMENTATIONS:
      raise ConfigError(f'LocalTraining.augment={self.augment!r} is unknown; choose one of {", ".join(AUGMENTATIONS)}.')
    object.__setattr__(self, 'augment_fill', tuple(float(v) for v in self.augment_fill))
    if self.order not in DATA_ORDERS:
      raise ConfigError(f'LocalTraining.order={self.order!r} is unknown; choose one of {", ".join(DATA_ORDERS)} '
                        f'(stored: HtFLlib, shuffle: PFLlib).')
    if self.batch_size < 1:
      raise ConfigError(f'LocalTraining.batch_size={self.batch_size} must be >= 1.')
    if self.epochs < 0:
      raise ConfigError(f'LocalTraining.epochs={self.epochs} must be >= 0.')
    if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
      raise ConfigError(f'LocalTraining.learning_rate={self.learning_rate} must be a finite number > 0.')
    if self.max_steps is not None and self.max_steps < 1:
      raise ConfigError(f'LocalTraining.max_steps={self.max_steps} must be >= 1 (None: whole LocalTraining.epochs epochs).')
    if self.rows is not None and self.rows < self.batch_size:
      raise ConfigError(f'LocalTraining.rows={self.rows} (generated rows per client) must be at least one batch '
                        f'(LocalTraining.batch_size={self.batch_size}).')

  def steps_per_epoch(self, n) -> int:
    """Local steps per epoch of a client with n training rows (the generated rows when `rows` is set): n // B full
    batches under drop_last, ceil(n / B) batches otherwise."""
    rows = self.rows if self.rows is not None else n
    return rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)

  def slots(self, n_max: int) -> int:
    """Step slots per epoch of a group padded to n_max rows (at least one)."""
    return max(int(self.steps_per_epoch(n_max)), 1)

  def optimizer(self) -> optax.GradientTransformation:
    """optax.sgd(learning_rate): plain SGD without momentum."""
    return optax.sgd(self.learning_rate)

  def statistics_rows(self, n: jnp.ndarray) -> jnp.ndarray:
    """How many of a client's n training rows (its first ones, in stored order) a statistics pass over the train
    loader sees: B*floor(n/B) under HtFLlib's stored order (drop_last), all n under 'shuffle' or without
    drop_last. A client with fewer rows than one batch, whose drop_last loader yields nothing, keeps all n so that
    its upload stays defined."""
    if self.order == 'shuffle' or not self.drop_last:
      return n
    used = n // self.batch_size * self.batch_size
    return used + (used == 0) * n  # `used` where positive, else n; arithmetic, so a host call compiles nothing


def batch_schedule(rng: jax.Array, n: jnp.ndarray, n_max: int, batch_size: int, epochs: int, order: str = 'stored',
                   drop_last: bool = True) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Row indices [epochs * S, batch_size] and validity [epochs * S] for S step slots per epoch (n_max // B under
  drop_last, ceil(n_max / B) otherwise).

  order 'stored': every epoch takes rows 0, 1, ... in order; 'shuffle': each epoch draws a fresh permutation of
  the client's n real rows (padding rows sort last and are never used). Step s of an epoch is valid iff
  s < n // B (drop_last) or s < ceil(n / B); without drop_last the rows of a valid step that are real are
  `batch_row_mask(s, n, B)` (the indices past them point at padding).
  """
  slots = n_max // batch_size if drop_last else -(-n_max // batch_size)
  steps = n // batch_size if drop_last else -(-n // batch_size)
  rows = jnp.arange(n_max)

  def one_epoch(e):
    if order == 'stored':
      perm = rows
    else:
      perm = shuffled_real_rows(jax.random.fold_in(rng, e), rows < n)
    perm = jnp.pad(perm, (0, max(slots * batch_size - n_max, 0)), mode='edge')[:slots * batch_size]
    return perm.reshape(slots, batch_size), jnp.arange(slots) < steps

  idx, valid = jax.vmap(one_epoch)(jnp.arange(epochs))
  return idx.reshape(epochs * slots, batch_size), valid.reshape(epochs * slots)


def batch_row_mask(slot, n, batch_size: int) -> jnp.ndarray:
  """[B] whether each row of step slot `slot` of an epoch is one of the client's n real rows (False in the padded
  tail of a partial last batch). Positions s * B + j of an epoch hold real rows iff they are < n, in stored and in
  shuffled order (padding sorts last)."""
  return slot * batch_size + jnp.arange(batch_size) < n


def step_key(rng: jax.Array, epoch, step) -> jax.Array:
  """The key of local step `step` of epoch `epoch` (independent of how many padded step slots exist)."""
  return jax.random.fold_in(jax.random.fold_in(rng, epoch + 1), step)
