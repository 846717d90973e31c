"""PyTorch's default initialisation of Conv and Linear layers, applied to Flax parameters.

HtFLlib builds every client's model right after `torch.manual_seed(0)`, with PyTorch's defaults: Conv2d and Linear
weights kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)), and biases
U(-1/sqrt(fan_in), 1/sqrt(fan_in)); BatchNorm/LayerNorm scale 1 and bias 0 (Flax's defaults already). Here every
Flax `Dense` (kernel [in, out], fan_in = in) and 2-D `Conv` (kernel [kh, kw, in / groups, out], fan_in =
kh * kw * in / groups) is redrawn that way, and a transposed convolution (`models.conv.conv_transpose`, a layer named
'convt...') with ConvTranspose2d's fan_in = kh * kw * out; other parameters (norm layers, ViT's class token and position table,
attention projections of rank-3 kernels, embeddings) keep their Flax initialisation.

Deviation: torchvision's ResNet, MobileNetV2, GoogLeNet and ViT constructors (which HtFLlib uses for those
architectures) re-initialise their own layers (kaiming-normal fan-out convolutions, small normal Linear layers);
that per-architecture scheme is not reproduced: the PyTorch default above applies to every architecture.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import jax
import jax.numpy as jnp

INITS = ('torch', 'flax')


def _is_torch_layer(node: Any) -> bool:
  return isinstance(node, dict) and 'kernel' in node and jnp.ndim(node['kernel']) in (2, 4)


def torch_default_init(params: Any, key: jax.Array) -> Any:
  """`params` with every Dense/Conv kernel and bias redrawn from U(-1/sqrt(fan_in), 1/sqrt(fan_in)).

  Each layer's draws come from `key` folded with a hash of the layer's path, so they do not depend on which other
  layers exist; pure and vmappable over `key`.
  """
  def visit(node, path):
    if _is_torch_layer(node):
      kernel = node['kernel']
      transposed = bool(path) and path[-1].startswith('convt')
      fan_in = math.prod(kernel.shape[:-2]) * kernel.shape[-1] if transposed else math.prod(kernel.shape[:-1])
      bound = 1.0 / math.sqrt(fan_in)
      layer_key = jax.random.fold_in(key, zlib.crc32('/'.join(path).encode()) & 0x7FFFFFFF)
      k_key, b_key = jax.random.split(layer_key)
      out = dict(node)
      out['kernel'] = jax.random.uniform(k_key, kernel.shape, kernel.dtype, -bound, bound)
      if 'bias' in node:
        out['bias'] = jax.random.uniform(b_key, node['bias'].shape, node['bias'].dtype, -bound, bound)
      return out
    if isinstance(node, dict):
      return {k: visit(v, path + (str(k),)) for k, v in node.items()}
    return node
  return visit(params, ())


def architecture_key(key: jax.Array, arch: str) -> jax.Array:
  """The initialisation key shared by every client of architecture `arch` (HtFLlib re-seeds before each client's
  model, so clients of one architecture start identical)."""
  return jax.random.fold_in(key, zlib.crc32(arch.encode()) & 0x7FFFFFFF)


def init_variables(module: Any, key: jax.Array, *inputs: Any, scheme: str = 'torch', path: tuple = ()) -> dict:
  """`module.init(key, *inputs)`'s variables; with scheme 'torch', its Dense/Conv layers redrawn by
  `torch_default_init` from fold_in(key, 1), each layer keyed by its path under `path` (a module initialised on
  its own with path=('companion',) draws what it would draw as the submodule 'companion' of a client)."""
  variables = dict(module.init(key, *inputs))
  if scheme == 'torch':
    params = variables['params']
    for name in reversed(path):
      params = {name: params}
    params = torch_default_init(params, jax.random.fold_in(key, 1))
    for name in path:
      params = params[name]
    variables['params'] = params
  return variables
