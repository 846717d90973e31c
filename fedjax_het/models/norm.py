"""BatchNorm with PyTorch's defaults, shared by every model ported from PyTorch, and the rows of a partial batch.

A partial last batch (a loader that keeps it, `LocalTraining.drop_last=False`) is padded to the full batch shape
so that every step compiles once; inside `batch_rows(mask)` every BatchNorm layer in train mode computes its batch
statistics (and its running-statistics update) over the rows where `mask` is True only, as PyTorch does on the
shorter batch. The mask reaches layers through a thread-local context rather than through every model's
signature (as flax's `logical_axis_rules` does): it is read while a function is traced, per host thread.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Iterator, Optional

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from fedjax_het.models.layers import given_param

_context = threading.local()
TORCH_MOMENTUM = 0.9  # torch's momentum 0.1 as flax counts it: the weight of the old running statistics


@contextlib.contextmanager
def batch_rows(mask: Optional[jnp.ndarray]) -> Iterator[None]:
  """Within the block, train-mode BatchNorm statistics count only the rows where mask [B] is True (None: all)."""
  previous = getattr(_context, 'mask', None)
  _context.mask = mask
  try:
    yield
  finally:
    _context.mask = previous


class BatchNorm(nn.Module):
  """torch.nn.BatchNorm2d: momentum 0.1 (flax's momentum is the complement, 0.9), eps 1e-5 (googlenet overrides
  1e-3); a train-mode step normalises with the batch's biased variance and moves the running variance towards the
  unbiased one, var * n / (n - 1) over the n values per channel (rows x positions), as torch does; statistics over
  the rows of `batch_rows` when one is active.

  The variables, their names and the arithmetic are `flax.linen.BatchNorm`'s over the last axis (its
  `use_fast_variance` statistics in float32, the same operations in the same order, so the same numbers): params
  'scale' and 'bias', 'batch_stats' 'mean' and 'var'. It is written out because flax's layer costs several times
  as much to trace (its params are shape-checked on every application by tracing their initialisers, which
  `models.layers.given_param` skips), and a ResNet-152 traces 155 of them per pass: most of a warm start's time.
  (Named BatchNorm so that its variables keep flax's names, e.g. 'BatchNorm_0'.)"""
  use_running_average: Optional[bool] = None
  momentum: float = TORCH_MOMENTUM
  epsilon: float = 1e-5

  @nn.compact
  def __call__(self, x, use_running_average=None, *, mask=None):
    rows = getattr(_context, 'mask', None)
    if mask is None and rows is not None:
      mask = jnp.broadcast_to(rows.reshape((-1,) + (1,) * (x.ndim - 1)), x.shape)
    training = not nn.merge_param('use_running_average', self.use_running_average, use_running_average)
    features = (x.shape[-1],)
    ra_mean = self.variable('batch_stats', 'mean', lambda s: jnp.zeros(s, jnp.float32), features)
    ra_var = self.variable('batch_stats', 'var', lambda s: jnp.ones(s, jnp.float32), features)
    scale = given_param(self, 'scale', nn.initializers.ones, features, jnp.float32)
    bias = given_param(self, 'bias', nn.initializers.zeros, features, jnp.float32)
    update = training and not self.is_initializing()
    y, mean, var = _batch_norm(x, None if mask is None else jnp.asarray(mask, dtype=bool), scale, bias,
                               ra_mean.value, ra_var.value, training=training, update=update,
                               momentum=self.momentum, epsilon=self.epsilon)
    if update:
      ra_mean.value, ra_var.value = mean, var
    return y


@functools.partial(jax.jit, static_argnames=('training', 'update', 'momentum', 'epsilon'), inline=True)
def _batch_norm(x, mask, scale, bias, ra_mean, ra_var, *, training: bool, update: bool, momentum: float,
                epsilon: float) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
  """`BatchNorm` on x [..., C] as (y, running mean, running variance), the running statistics updated where
  `update`. Jitted so that JAX traces it once per shape and setting (a ResNet-152 applies 155 of these layers, in a
  few shapes, and jnp's arithmetic traced in place costs several times what the cached trace's inlining does), and
  inlined: a call left in the program changes where XLA rounds bfloat16 values."""
  features = (x.shape[-1],)
  axes = tuple(range(x.ndim - 1))
  if not training:
    mean, var = ra_mean, ra_var
  else:
    stats = x.astype(jnp.promote_types(jnp.result_type(x), jnp.float32))
    squares = lax.square(stats)  # before the mean, as flax: the gradient's sums then add up in flax's order
    mean, mean_square = stats.mean(axes, where=mask), squares.mean(axes, where=mask)
    var = jnp.maximum(0.0, mean_square - lax.square(mean))
    if update:
      old = ra_var
      ra_mean = momentum * ra_mean + (1 - momentum) * mean
      new = momentum * old + (1 - momentum) * var
      n = mask[..., 0].sum().astype(jnp.float32) if mask is not None else jnp.float32(x.size // x.shape[-1])
      bessel = jnp.where(n > 1, n / jnp.maximum(n - 1, 1.0), 1.0)
      ra_var = momentum * old + (new - momentum * old) * bessel
  y = x - jnp.expand_dims(mean, axes)
  mul = lax.rsqrt(jnp.expand_dims(var, axes) + epsilon)
  y *= mul * scale.reshape((1,) * (x.ndim - 1) + features)
  y += bias.reshape((1,) * (x.ndim - 1) + features)
  return jnp.asarray(y, jnp.result_type(x, scale, bias)), ra_mean, ra_var


TorchBatchNorm = BatchNorm


def batch_statistics(model: nn.Module, variables: dict, x: jnp.ndarray, mask: Optional[jnp.ndarray] = None) -> Any:
  """The 'batch_stats' collection holding the batch mean and unbiased variance (torch's running-statistics update)
  of each BatchNorm layer of `model` in a train-mode pass over the rows of x where mask [B] is True: the running
  statistics one update from zero, divided by the update's weight (1 - momentum)."""
  zero = {**variables, 'batch_stats': jax.tree.map(jnp.zeros_like, variables['batch_stats'])}
  with batch_rows(mask):
    _, updated = model.apply(zero, x, train=True, mutable=['batch_stats'])
  return jax.tree.map(lambda a: a / (1.0 - TORCH_MOMENTUM), updated['batch_stats'])
