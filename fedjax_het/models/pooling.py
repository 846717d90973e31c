"""Representation mapping (RM) to a common width d: PyTorch-style 1-D adaptive pooling of the channel vector."""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp


def adaptive_bins(length: int, size: int) -> list[tuple[int, int]]:
  """PyTorch's adaptive-pooling bins: output i covers [floor(i*L/d), ceil((i+1)*L/d)); bins overlap if d does not
  divide L."""
  return [((i * length) // size, -((-(i + 1) * length) // size)) for i in range(size)]


def adaptive_bin_mask(length: int, size: int) -> np.ndarray:
  """[L, d] 0/1 matrix with column i marking the inputs of output bin i."""
  mask = np.zeros((length, size), np.float32)
  for i, (start, end) in enumerate(adaptive_bins(length, size)):
    mask[start:end, i] = 1.0
  return mask


def adaptive_avg_pool1d(v: jnp.ndarray, size: int) -> jnp.ndarray:
  """torch.nn.functional.adaptive_avg_pool1d over the last axis of v [..., L] -> [..., size]."""
  length = v.shape[-1]
  if length == size:
    return v
  mask = adaptive_bin_mask(length, size)
  return v @ jnp.asarray(mask / mask.sum(0, keepdims=True), v.dtype)


def adaptive_max_pool1d(v: jnp.ndarray, size: int) -> jnp.ndarray:
  """torch.nn.functional.adaptive_max_pool1d over the last axis of v [..., L] -> [..., size]."""
  length = v.shape[-1]
  if length == size:
    return v
  mask = jnp.asarray(adaptive_bin_mask(length, size).T, bool)  # [d, L]
  return jnp.max(jnp.where(mask, v[..., None, :], -jnp.inf), axis=-1)
