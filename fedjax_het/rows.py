"""Random draws keyed per row, so that padding a client with extra rows never changes a draw for a real row."""

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
