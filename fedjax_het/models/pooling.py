"""Pooling: PyTorch-style 1-D adaptive pooling of the channel vector (RM to a common width d), and 2-D max pooling."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


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


def max_pool(x: jnp.ndarray, window: tuple[int, int], strides: tuple[int, int] | None = None,
             padding: str | tuple = 'VALID') -> jnp.ndarray:
  """2-D max pooling of NHWC x, as `flax.linen.max_pool`.

  Non-overlapping windows (window == strides, 'VALID' or 'SAME') are computed by `window_max`: the same values,
  PyTorch's gradient (all of a window's gradient to its first maximal element in row-major order, where a
  reduce-max splits it among ties), through selects (benchmarks/cpu_kernels.py --parts=pool,step times it). A
  select cannot lose the gradient as a reduce-max's VJP can at XLA:CPU's optimisation level 0 (its tie count
  compares values that one fusion FMA-contracted and another did not; docs/xla_cpu_miscompile.md). Other windows use `flax.linen.max_pool`.
  """
  strides = tuple(strides or window)
  if tuple(window) != strides or not isinstance(padding, str):
    return nn.max_pool(x, tuple(window), strides, padding=padding)
  (h, w), (kh, kw) = x.shape[1:3], window
  if padding == 'SAME':
    ph, pw = -h % kh, -w % kw
    x = jnp.pad(x, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)), constant_values=-jnp.inf)
  else:
    x = x[:, :h // kh * kh, :w // kw * kw]
  b, h, w, c = x.shape
  return window_max(x.reshape(b, h // kh, kh, w // kw, kw, c))


def window_max(windows: jnp.ndarray) -> jnp.ndarray:
  """[b, H, kh, W, kw, c] -> [b, H, W, c]: the maximum of each window as a running maximum that a later element
  replaces only when larger, so the gradient goes to the window's first maximal element (row-major) and no value is
  compared twice. The gradient is written in one pass from each output's winning position (`_window_max_vjp`),
  where differentiating the selects would sum kh * kw padded copies of the strided slices."""
  return _window_max_vjp(windows.shape[2], windows.shape[4])(windows)


def _running_max(windows: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
  """(the windows' maxima, the row-major position in its window of each maximum's first occurrence, int8)."""
  kh, kw = windows.shape[2], windows.shape[4]
  out = windows[:, :, 0, :, 0]
  winner = jnp.zeros(out.shape, jnp.int8)
  for k in range(1, kh * kw):
    later = windows[:, :, k // kw, :, k % kw]
    larger = later > out
    out = jnp.where(larger, later, out)
    winner = jnp.where(larger, jnp.int8(k), winner)
  return out, winner


@functools.lru_cache(maxsize=None)
def _window_max_vjp(kh: int, kw: int):
  """`window_max` for kh x kw windows with its gradient: each output's cotangent placed at its winner."""
  @jax.custom_vjp
  def pool(windows):
    return _running_max(windows)[0]

  def forward(windows):
    out, winner = _running_max(windows)
    return out, winner

  def backward(winner, g):
    position = jnp.arange(kh * kw, dtype=jnp.int8).reshape(1, 1, kh, 1, kw, 1)
    spread = lambda a: a[:, :, None, :, None, :]  # [b, H, 1, W, 1, c]
    return (jnp.where(spread(winner) == position, spread(g), jnp.zeros((), g.dtype)),)  # [b, H, kh, W, kw, c]

  pool.defvjp(forward, backward)
  return pool
