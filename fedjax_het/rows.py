"""Row-level helpers that make padding invisible: random draws keyed per row (padding a client with extra rows never
changes a draw for a real row) and batch means over the real rows of a padded batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_keys(key: jax.Array, num_rows: int) -> jax.Array:
  """Key i = fold_in(key, i) for i < num_rows: row i's draws do not depend on how many rows follow it."""
  return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(num_rows))


def row_uniform(key: jax.Array, num_rows: int) -> jnp.ndarray:
  """One U(0,1) per row, independent of num_rows for every existing row."""
  return jax.vmap(lambda k: jax.random.uniform(k))(row_keys(key, num_rows))


def shuffled_real_rows(key: jax.Array, valid: jnp.ndarray) -> jnp.ndarray:
  """A random order of the rows with valid=True first (padding rows last), independent of padding."""
  return jnp.argsort(jnp.where(valid, row_uniform(key, valid.shape[0]), 2.0))


def batch_mean(values: jnp.ndarray, mask: jnp.ndarray | None = None) -> jnp.ndarray:
  """The mean of values [B, ...] over all entries, or over the entries of the rows where mask [B] is True (a
  padded partial batch, `Batch.mask`): what the mean gives on the batch of real rows alone (0 if there is none)."""
  if mask is None:
    return values.mean()
  m = jnp.broadcast_to(mask.reshape((-1,) + (1,) * (values.ndim - 1)), values.shape).astype(values.dtype)
  return jnp.sum(values * m) / jnp.maximum(jnp.sum(m), 1.0)


def row_weights(mask: jnp.ndarray | None, values: jnp.ndarray) -> jnp.ndarray | float:
  """mask [B] as 0/1 weights broadcastable against values [B, ...] (1.0 without a mask): for losses summed over
  the batch."""
  if mask is None:
    return 1.0
  return mask.reshape((-1,) + (1,) * (values.ndim - 1)).astype(values.dtype)
