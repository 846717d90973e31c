"""Distillation on the server's public dataset (FedMD, FedDF): its rows as a local stage's schedule, a model's
logits over all of them, and the mean of the participants' logits (the consensus, or ensemble target).

The public images are the algorithm's constants (`Algorithm.constants`, a `PublicSet`): the engine keeps them on
device once and passes them to every compiled program as an argument (a closed-over array would be compiled into
each program as a constant): a server step takes them as its fourth argument, and a program reads them where its
phase's `Phase.with_constants` puts them in its broadcast; a stage over them names rows by `Batch.index`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_het.data.federated import PublicData
from fedjax_het.local_training import LocalTraining
from fedjax_het.models.forward import forward
from fedjax_het.uploads import RoundUploads, masked_mean


class PublicSet(NamedTuple):
  """The server's public rows as arrays on device: images x [P, H, W, c] and labels y [P]."""
  x: jnp.ndarray
  y: jnp.ndarray


class PublicRows:
  """The server's public dataset as an algorithm's constants, and the schedule of a stage over its rows."""

  def __init__(self, public: PublicData):
    self.source, self.size = public.source, int(public.y.shape[0])
    self.constants = PublicSet(jnp.asarray(public.x), jnp.asarray(public.y, jnp.int32))

  def training(self, batch_size: int, order: str) -> LocalTraining:
    """A stage's schedule over the P public rows (`Stage.training`; the stage sets the epochs): P // B batches an
    epoch (the last partial batch dropped) in `order`; every client takes all of them whatever its own data, and
    --local_steps does not cap them."""
    return LocalTraining(batch_size=min(batch_size, self.size), order=order, rows=self.size)

  @staticmethod
  def batch(public: PublicSet, index: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(images, labels) of the public rows `index` [B]."""
    return public.x[index], public.y[index]


def public_logits(model, params: Any, model_state: Any, x: jnp.ndarray, chunk: int = 500) -> jnp.ndarray:
  """Eval-mode logits [P, C] of a classifier on all P rows of x, in passes of at most `chunk` rows (a lax.map,
  so that a vmapped group never holds the activations of all P rows at once)."""
  p = x.shape[0]
  chunk = min(chunk, p)
  passes = -(-p // chunk)
  padded = jnp.pad(x, [(0, passes * chunk - p)] + [(0, 0)] * (x.ndim - 1))
  logits = jax.lax.map(lambda rows: forward(model, params, model_state, rows, False)[0],
                       padded.reshape((passes, chunk) + x.shape[1:]))
  return logits.reshape((passes * chunk,) + logits.shape[2:])[:p]


def mean_of_uploads(uploads: RoundUploads, part: str) -> jnp.ndarray:
  """The unweighted mean over every group's participants of upload part `part` (FedMD's consensus: the mean of
  their public logits); zeros when nobody took part."""
  every = uploads.every(part)
  return masked_mean(every.values, every.mask)
