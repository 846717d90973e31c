"""Convolution formulations: XLA's native convolution, or image patches times a matrix.

Both compute `lax.conv_general_dilated` with the same parameters (Flax `nn.Conv`'s 'kernel' [kh, kw, C, O] and
'bias'); they differ in how they batch. Under `jax.vmap` over clients, each client has its own kernel, so XLA's
convolution becomes a grouped convolution (feature_group_count = clients), which XLA:CPU runs several times slower
than the same work as a batched matrix multiply. The 'patches' form extracts patches with a fixed one-hot kernel
(shared by every client, so vmap folds clients into the batch) and contracts them with each client's kernel as a
batched matmul. Figures: benchmarks/strategies.py and the README.
"""

from __future__ import annotations

import functools
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from fedjax_het.errors import ConfigError


def _channels_last(nd: int) -> lax.ConvDimensionNumbers:
  spatial = tuple(range(1, nd + 1))
  return lax.ConvDimensionNumbers((0, nd + 1) + spatial, (nd + 1, nd) + tuple(range(nd)), (0, nd + 1) + spatial)


def patches_conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                                 dimension_numbers=None, feature_group_count=1, batch_group_count=1,
                                 precision=None, preferred_element_type=None) -> jax.Array:
  """`lax.conv_general_dilated` as patches @ kernel, for channels-last (NHWC, HWIO) ungrouped convolutions.

  out[n, p, o] = sum_{c, k} patches[n, p, (c, k)] * rhs[k, c, o], where patches come from
  `lax.conv_general_dilated_patches` (channel-major feature order). Other layouts, grouped (e.g. depthwise) and
  input-dilated convolutions fall back to `lax.conv_general_dilated`.
  """
  nd = lhs.ndim - 2
  dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
  plain = (feature_group_count == 1 and batch_group_count == 1 and dn == _channels_last(nd)
           and (lhs_dilation is None or all(d == 1 for d in lhs_dilation)))
  if not plain:
    return lax.conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dn,
                                    feature_group_count, batch_group_count, precision, preferred_element_type)
  window = rhs.shape[:nd]
  patches = lax.conv_general_dilated_patches(lhs, window, window_strides, padding, rhs_dilation=rhs_dilation,
                                             dimension_numbers=dn, precision=precision)
  kernel = jnp.moveaxis(rhs, nd, 0).reshape(-1, rhs.shape[-1])  # [C * prod(window), O], channel-major
  return lax.dot_general(patches, kernel, (((patches.ndim - 1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=preferred_element_type)


ConvFactory = Callable[..., nn.Module]
CONV_IMPLS: dict[str, ConvFactory] = {
    'xla': nn.Conv,
    'patches': functools.partial(nn.Conv, conv_general_dilated=patches_conv_general_dilated),
}


def conv_factory(impl: str) -> ConvFactory:
  """The `nn.Conv`-compatible constructor of convolution formulation `impl` ('xla' or 'patches')."""
  if impl not in CONV_IMPLS:
    raise ConfigError(f'--conv={impl!r} is unknown; choose one of {", ".join(CONV_IMPLS)}.')
  return CONV_IMPLS[impl]
