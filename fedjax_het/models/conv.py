"""Convolution formulations: XLA's native convolution, im2col (image patches times the kernel as a matrix),
oneDNN's convolution as a custom call on the CPU (kernels/onednn.py), or Pallas kernels that compute im2col's sums
without writing the patches (kernels/pallas_conv.py, GPUs).

All compute `lax.conv_general_dilated` with the same parameters (Flax `nn.Conv`'s 'kernel' [kh, kw, C, O] and
'bias'); they differ in speed. Under `jax.vmap` over clients each client has its own kernel, so XLA's convolution
becomes a grouped convolution (feature_group_count = clients), which XLA:CPU runs several times slower than the
same work as a batched matmul; and XLA:CPU's convolution with few input channels is slow even unbatched. im2col
gathers patches with strided slices (batched trivially by vmap; their gradient is pads and adds) and contracts
them with the kernel in one matmul. Figures: benchmarks/cpu_kernels.py and docs/performance.md.
"""

from __future__ import annotations

import functools
import itertools
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from fedjax_het.errors import ConfigError
from fedjax_het.kernels import onednn, pallas_conv
from fedjax_het.models.layers import Conv


IM2COL_MAX_CHANNELS = 8  # 'auto' uses im2col up to this many input channels


def _channels_last_numbers(nd: int) -> lax.ConvDimensionNumbers:
  spatial = tuple(range(1, nd + 1))
  return lax.ConvDimensionNumbers((0, nd + 1) + spatial, (nd + 1, nd) + tuple(range(nd)), (0, nd + 1) + spatial)


def _channels_last(lhs, rhs, dimension_numbers, lhs_dilation, batch_group_count) -> bool:
  """Whether a convolution is NHWC/HWIO (channels last) without input dilation or batch groups (feature groups
  allowed)."""
  dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
  return (batch_group_count == 1 and dn == _channels_last_numbers(lhs.ndim - 2)
          and (lhs_dilation is None or all(d == 1 for d in lhs_dilation)))


def _ungrouped_channels_last(lhs, rhs, dimension_numbers, lhs_dilation, feature_group_count, batch_group_count
                             ) -> bool:
  """Whether a convolution is the plain kind the matmul formulations here compute: NHWC/HWIO (channels last), no
  groups, no input dilation."""
  return feature_group_count == 1 and _channels_last(lhs, rhs, dimension_numbers, lhs_dilation, batch_group_count)


def _explicit_padding(lhs, rhs, window_strides, padding, rhs_dilation) -> tuple[list, tuple]:
  """(padding as (low, high) per spatial axis, the kernel's dilation) of a channels-last convolution; a padding
  string ('SAME', 'VALID') is resolved over the dilated kernel, as lax does."""
  nd = lhs.ndim - 2
  dilation = tuple(int(d) for d in (rhs_dilation or (1,) * nd))
  if isinstance(padding, str):
    effective = [(k - 1) * d + 1 for k, d in zip(rhs.shape[:nd], dilation)]
    padding = lax.padtype_to_pads(lhs.shape[1:-1], effective, window_strides, padding)
  return [(int(lo), int(hi)) for lo, hi in padding], dilation


def im2col_conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                                dimension_numbers=None, feature_group_count=1, batch_group_count=1, precision=None,
                                preferred_element_type=None) -> jax.Array:
  """`lax.conv_general_dilated` as im2col: patches gathered by strided slices, times the kernel as a matrix.

  out[n, y, x, o] = sum_{i, j, c} lhs_pad[n, y*s + i*d, x*s + j*d, c] * rhs[i, j, c, o]: the kh*kw shifted slices
  are concatenated on the channel axis ((i, j, c) order, matching rhs.reshape(-1, O)) and contracted in one
  matmul. Its gradient is slices/pads and matmuls too, so it stays cheap under vmap. Channels-last (NHWC, HWIO)
  ungrouped convolutions only; anything else falls back to `lax.conv_general_dilated`.
  """
  if not _ungrouped_channels_last(lhs, rhs, dimension_numbers, lhs_dilation, feature_group_count,
                                  batch_group_count):
    return lax.conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
                                    dimension_numbers, feature_group_count, batch_group_count, precision,
                                    preferred_element_type)
  patches = image_patches(lhs, rhs.shape, window_strides, padding, rhs_dilation)
  return lax.dot_general(patches, rhs.reshape(-1, rhs.shape[-1]), (((lhs.ndim - 1,), (0,)), ((), ())),
                         precision=precision, preferred_element_type=preferred_element_type)


def image_patches(lhs, kernel_shape, window_strides, padding, rhs_dilation=None) -> jax.Array:
  """The im2col patches [N, *out, kh*kw*C] of a channels-last convolution of lhs [N, *spatial, C] with a kernel of
  `kernel_shape` [kh, kw, C, O]: the kh*kw shifted, strided slices of the padded input concatenated on the channel
  axis in (i, j, c) order, so that patches @ kernel.reshape(-1, O) is the convolution."""
  nd = lhs.ndim - 2
  padding, dilation = _explicit_padding(lhs, jax.ShapeDtypeStruct(kernel_shape, lhs.dtype), window_strides,
                                        padding, rhs_dilation)
  window = kernel_shape[:nd]
  effective = [(k - 1) * d + 1 for k, d in zip(window, dilation)]
  x = jnp.pad(lhs, [(0, 0)] + padding + [(0, 0)])
  out = [(x.shape[1 + a] - effective[a]) // window_strides[a] + 1 for a in range(nd)]
  slices = []
  for offset in itertools.product(*[range(k) for k in window]):
    start = [0] + [o * d for o, d in zip(offset, dilation)] + [0]
    limit = [x.shape[0]] + [s + (n - 1) * st + 1 for s, n, st in zip(start[1:], out, window_strides)] + [x.shape[-1]]
    slices.append(lax.slice(x, start, limit, [1] + list(window_strides) + [1]))
  return jnp.concatenate(slices, axis=-1) if len(slices) > 1 else slices[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _conv_gemm_grad(lhs, rhs, window_strides, padding, rhs_dilation):
  return lax.conv_general_dilated(lhs, rhs, window_strides, padding, rhs_dilation=rhs_dilation,
                                  dimension_numbers=_channels_last_numbers(lhs.ndim - 2))


def _conv_gemm_grad_fwd(lhs, rhs, window_strides, padding, rhs_dilation):
  return _conv_gemm_grad(lhs, rhs, window_strides, padding, rhs_dilation), (lhs, rhs)


def _conv_gemm_grad_bwd(window_strides, padding, rhs_dilation, residuals, g):
  lhs, rhs = residuals
  conv = lambda x: lax.conv_general_dilated(x, rhs, window_strides, padding, rhs_dilation=rhs_dilation,
                                           dimension_numbers=_channels_last_numbers(lhs.ndim - 2))
  d_lhs = jax.vjp(conv, lhs)[1](g)[0]  # XLA's input gradient (a transposed convolution)
  patches = image_patches(lhs, rhs.shape, window_strides, padding, rhs_dilation)
  batch_axes = tuple(range(patches.ndim - 1))
  d_rhs = lax.dot_general(patches, g.astype(patches.dtype), ((batch_axes, batch_axes), ((), ())))
  return d_lhs, d_rhs.reshape(rhs.shape).astype(rhs.dtype)


_conv_gemm_grad.defvjp(_conv_gemm_grad_fwd, _conv_gemm_grad_bwd)


def gemm_grad_conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                                   dimension_numbers=None, feature_group_count=1, batch_group_count=1,
                                   precision=None, preferred_element_type=None) -> jax.Array:
  """`lax.conv_general_dilated` whose forward pass and input gradient are XLA's convolutions and whose kernel
  gradient is one matmul, patches^T @ output gradient (`image_patches`). Under `jax.vmap` over clients XLA turns a
  convolution's kernel gradient into a grouped convolution with image-sized windows, which GPUs run slowly; this
  one becomes a batched matmul over the client axis. Channels-last ungrouped convolutions with default precision
  only; anything else is `lax.conv_general_dilated`."""
  if (precision is not None or preferred_element_type is not None or not _ungrouped_channels_last(
      lhs, rhs, dimension_numbers, lhs_dilation, feature_group_count, batch_group_count)):
    return lax.conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
                                    dimension_numbers, feature_group_count, batch_group_count, precision,
                                    preferred_element_type)
  pads, dilation = _explicit_padding(lhs, rhs, window_strides, padding, rhs_dilation)
  return _conv_gemm_grad(lhs, rhs, tuple(int(s) for s in window_strides), tuple(tuple(p) for p in pads), dilation)


def auto_conv_general_dilated(lhs, rhs, *args, max_channels: int = IM2COL_MAX_CHANNELS, **kwargs) -> jax.Array:
  """im2col for convolutions with at most `max_channels` input channels (XLA:CPU's native convolution is ~10x
  slower than a matmul for e.g. 3 -> 32 channels, see docs/performance.md), XLA's convolution otherwise."""
  if rhs.ndim >= 3 and rhs.shape[-2] <= max_channels:
    return im2col_conv_general_dilated(lhs, rhs, *args, **kwargs)
  return lax.conv_general_dilated(lhs, rhs, *args, **kwargs)


def onednn_conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                                dimension_numbers=None, feature_group_count=1, batch_group_count=1, precision=None,
                                preferred_element_type=None) -> jax.Array:
  """`lax.conv_general_dilated` by oneDNN's custom calls (`kernels.onednn.conv2d`) for 2-D channels-last float32
  convolutions on the CPU, grouped (depthwise included) or not; anything else (other layouts, batch groups, input
  dilation, dtypes, cropping, another backend) by `lax.conv_general_dilated`. Raises OneDNNUnavailable (with its
  fix) when oneDNN cannot be loaded."""
  plain = (lhs.ndim == 4 and jax.default_backend() == 'cpu' and lhs.dtype == jnp.float32
           and rhs.dtype == jnp.float32 and preferred_element_type in (None, jnp.float32)
           and _channels_last(lhs, rhs, dimension_numbers, lhs_dilation, batch_group_count))
  if plain:
    pads, dilation = _explicit_padding(lhs, rhs, window_strides, padding, rhs_dilation)
    if all(p >= 0 for pair in pads for p in pair):  # oneDNN pads only; lax also crops
      return onednn.conv2d(lhs, rhs, window_strides, pads, dilation, feature_group_count)
  return lax.conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
                                  feature_group_count, batch_group_count, precision, preferred_element_type)


def pallas_conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                                dimension_numbers=None, feature_group_count=1, batch_group_count=1, precision=None,
                                preferred_element_type=None) -> jax.Array:
  """`lax.conv_general_dilated` by Pallas kernels (`kernels.pallas_conv.conv2d`: no patches in memory, one launch
  per kernel for a vmapped chunk of clients) for 2-D channels-last ungrouped stride-1 undilated float32/bfloat16
  convolutions with non-negative padding; anything else (strided layers among them) by im2col, whose patches a
  stride shrinks."""
  plain = (lhs.ndim == 4 and lhs.dtype in (jnp.float32, jnp.bfloat16) and rhs.dtype == lhs.dtype
           and preferred_element_type is None and all(s == 1 for s in window_strides)
           and (rhs_dilation is None or all(d == 1 for d in rhs_dilation))
           and _ungrouped_channels_last(lhs, rhs, dimension_numbers, lhs_dilation, feature_group_count,
                                        batch_group_count))
  if plain:
    pads, _ = _explicit_padding(lhs, rhs, window_strides, padding, rhs_dilation)
    if all(p >= 0 for pair in pads for p in pair):
      return pallas_conv.conv2d(lhs, rhs, pads, precision)
  return im2col_conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
                                     dimension_numbers, feature_group_count, batch_group_count, precision,
                                     preferred_element_type)


ConvFactory = Callable[..., nn.Module]
CONV_IMPLS: dict[str, ConvFactory] = {  # the formulations a run chooses from (--conv)
    'xla': Conv,
    'im2col': functools.partial(Conv, conv_general_dilated=im2col_conv_general_dilated),
    'auto': functools.partial(Conv, conv_general_dilated=auto_conv_general_dilated),
    'onednn': functools.partial(Conv, conv_general_dilated=onednn_conv_general_dilated),
    'gemm': functools.partial(Conv, conv_general_dilated=gemm_grad_conv_general_dilated),
    'pallas': functools.partial(Conv, conv_general_dilated=pallas_conv_general_dilated),
}
# Eval-mode representation passes of an 'auto' run: im2col up to 32 input channels. Without a backward pass and
# in 32-row passes its patches stay small, and it is faster there than 'auto', where in training steps on two
# client threads it is slower (docs/performance.md, benchmarks/cpu_kernels.py --parts=represent).
EVAL_PASS_CONV = {'auto': 'auto_eval_pass'}
_FORMULATIONS: dict[str, ConvFactory] = {
    **CONV_IMPLS,
    'auto_eval_pass': functools.partial(Conv, conv_general_dilated=functools.partial(auto_conv_general_dilated,
                                                                                        max_channels=32)),
}


def dilate(x: jnp.ndarray, stride: int) -> jnp.ndarray:
  """x [N, H, W, C] with stride - 1 zero rows and columns inserted between its rows and columns."""
  if stride == 1:
    return x
  n, h, w, c = x.shape
  return jnp.zeros((n, (h - 1) * stride + 1, (w - 1) * stride + 1, c), x.dtype).at[:, ::stride, ::stride].set(x)


def conv_transpose(impl: str, x: jnp.ndarray, features: int, kernel: int, stride: int, padding: int, name: str
                   ) -> jnp.ndarray:
  """PyTorch's ConvTranspose2d(in, features, kernel, stride, padding) on x [N, H, W, in] (output side
  (H - 1) * stride - 2 * padding + kernel), computed as what it is: a convolution of formulation `impl` over x
  dilated with stride - 1 zeros and padded by kernel - 1 - padding. Its kernel [k, k, in, out] is PyTorch's
  flipped with its axes swapped, a reparametrisation of a learned kernel; `name` should start with 'convt' so
  that `models.init.torch_default_init` draws it with ConvTranspose2d's fan-in (out * k * k). Call it inside a
  compact module's __call__ (the layer becomes that module's submodule `name`)."""
  edge = kernel - 1 - padding
  return conv_factory(impl)(features, (kernel, kernel), padding=[(edge, edge)] * 2, name=name)(dilate(x, stride))


def conv_factory(impl: str) -> ConvFactory:
  """The `nn.Conv`-compatible constructor of convolution formulation `impl`: one of `CONV_IMPLS`, or an eval-pass
  formulation named in `EVAL_PASS_CONV`."""
  if impl not in _FORMULATIONS:
    raise ConfigError(f'ExecutionConfig.conv={impl!r} is unknown; choose one of {", ".join(CONV_IMPLS)}.')
  return _FORMULATIONS[impl]
