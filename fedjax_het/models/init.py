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

import functools
import math
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

INITS = ('torch', 'flax')
_BLOCK = 1024  # elements of `torch_default_init`'s stream that share one layer's key
_PASS_BLOCKS = 16  # blocks hashed at once


def _is_torch_layer(node: Any) -> bool:
  return isinstance(node, dict) and 'kernel' in node and jnp.ndim(node['kernel']) in (2, 4)


def _torch_layers(params: Any) -> list[tuple[tuple, dict]]:
  """(path, layer) of every Dense/Conv layer of `params`, in the tree's order."""
  found = []

  def visit(node, path):
    if _is_torch_layer(node):
      found.append((path, node))
    elif isinstance(node, dict):
      for k, v in node.items():
        visit(v, path + (str(k),))
  visit(params, ())
  return found


def torch_default_init(params: Any, key: jax.Array) -> Any:
  """`params` with every Dense/Conv kernel and bias redrawn from U(-1/sqrt(fan_in), 1/sqrt(fan_in)).

  Each layer's draws come from `key` folded with a hash of the layer's path, so they do not depend on which other
  layers exist; pure and vmappable over `key`. A layer's kernel is `jax.random.uniform(k, shape, dtype, -bound,
  bound)` of the first key of `jax.random.split(fold_in(key, hash))`, its bias of the second: the same bits, but
  all layers drawn in one pass of the threefry hash over a flat stream (one hash per element, its layer's key
  and its index in the layer as counter, as JAX's partitionable threefry numbers them), because XLA compiles
  each separate draw as its own hash kernel (about 0.1-0.4 s each on a CPU, for a ResNet dozens of them) while
  one pass compiles once.
  """
  layers = _torch_layers(params)
  if not layers:
    return params
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    if str(jax.random.key_impl(key)) != 'threefry2x32':
      return _per_layer_init(params, key, layers)
    key = jax.random.key_data(key)
  if not jax.config.jax_threefry_partitionable:
    return _per_layer_init(params, key, layers)
  hashes = jnp.asarray([zlib.crc32('/'.join(path).encode()) & 0x7FFFFFFF for path, _ in layers], jnp.uint32)
  layer_keys = jax.vmap(lambda h: jax.random.split(jax.random.fold_in(key, h)))(hashes)  # [layers, 2, 2]
  entries = []  # (layer index, 0 kernel / 1 bias, name, shape, dtype, bound)
  for li, (path, node) in enumerate(layers):
    bound = _bound(path, node['kernel'].shape)
    entries.append((li, 0, 'kernel', node['kernel'].shape, node['kernel'].dtype, bound))
    if 'bias' in node:
      entries.append((li, 1, 'bias', node['bias'].shape, node['bias'].dtype, bound))
  sizes = np.array([math.prod(e[3]) for e in entries], np.int64)
  blocks = -(-sizes // _BLOCK)  # each entry starts a block of its own, so a block's elements share one key
  if int(blocks.sum()) * _BLOCK >= 2**32 or any(jnp.dtype(e[4]) != jnp.float32 for e in entries):
    return _per_layer_init(params, key, layers)
  block_entry = np.repeat(np.arange(len(entries)), blocks)
  block_first = np.concatenate([np.arange(n) * _BLOCK for n in blocks]).astype(np.uint32)  # its first counter
  pad = -len(block_entry) % _PASS_BLOCKS  # whole passes; the padding's draws are dropped
  block_entry, block_first = np.pad(block_entry, (0, pad)), np.pad(block_first, (0, pad))
  entry_keys = layer_keys[np.array([e[0] for e in entries]), np.array([e[1] for e in entries])]  # [entries, 2]
  bounds = jnp.asarray([e[5] for e in entries], jnp.float32)

  def one_pass(blocks_of_pass):  # _PASS_BLOCKS blocks, so that the hash's loop state stays in cache
    entry, first = blocks_of_pass
    counter = first[:, None] + jax.lax.iota(jnp.uint32, _BLOCK)[None, :]
    shape = counter.shape
    keys = entry_keys[entry]
    bits1, bits2 = threefry2x32_p.bind(jnp.broadcast_to(keys[:, :1], shape), jnp.broadcast_to(keys[:, 1:], shape),
                                       jnp.zeros(shape, jnp.uint32), counter)
    # jax.random.uniform's map of 32 random bits to [minval, maxval), operation for operation.
    floats = jax.lax.bitcast_convert_type(jax.lax.shift_right_logical(bits1 ^ bits2, jnp.uint32(9))
                                          | jnp.uint32(0x3F800000), jnp.float32) - jnp.float32(1.0)
    low, high = -bounds[entry][:, None], bounds[entry][:, None]
    return jax.lax.max(low, floats * (high - low) + low)
  passes = (jnp.asarray(block_entry.reshape(-1, _PASS_BLOCKS)), jnp.asarray(block_first.reshape(-1, _PASS_BLOCKS)))
  stream = jax.lax.map(one_pass, passes).reshape(-1)
  starts = np.concatenate([[0], np.cumsum(blocks)[:-1]]) * _BLOCK
  out = _copy_tree(params)
  for (li, _, name, shape, _, _), start, size in zip(entries, starts, sizes):
    node = functools.reduce(lambda n, k: n[k], layers[li][0], out)
    node[name] = jax.lax.slice(stream, (int(start),), (int(start + size),)).reshape(shape)
  return out


def _bound(path: tuple, kernel_shape: tuple) -> float:
  """1/sqrt(fan_in) of a layer (a transposed convolution's fan_in as ConvTranspose2d's)."""
  transposed = bool(path) and path[-1].startswith('convt')
  fan_in = math.prod(kernel_shape[:-2]) * kernel_shape[-1] if transposed else math.prod(kernel_shape[:-1])
  return 1.0 / math.sqrt(fan_in)


def _copy_tree(tree: Any) -> Any:
  return {k: _copy_tree(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def _per_layer_init(params: Any, key: jax.Array, layers: list) -> Any:
  """`torch_default_init` one `jax.random.uniform` per kernel and bias (other key types, other dtypes)."""
  out = _copy_tree(params)
  for path, node in layers:
    bound = _bound(path, node['kernel'].shape)
    layer_key = jax.random.fold_in(key, zlib.crc32('/'.join(path).encode()) & 0x7FFFFFFF)
    k_key, b_key = jax.random.split(layer_key)
    dest = functools.reduce(lambda n, k: n[k], path, out)
    dest['kernel'] = jax.random.uniform(k_key, node['kernel'].shape, node['kernel'].dtype, -bound, bound)
    if 'bias' in node:
      dest['bias'] = jax.random.uniform(b_key, node['bias'].shape, node['bias'].dtype, -bound, bound)
  return out


def architecture_key(key: jax.Array, arch: str) -> jax.Array:
  """The initialisation key shared by every client of architecture `arch` (HtFLlib re-seeds before each client's
  model, so clients of one architecture start identical)."""
  return jax.random.fold_in(key, zlib.crc32(arch.encode()) & 0x7FFFFFFF)


def init_with_output(module: Any, key: jax.Array, *inputs: Any, scheme: str = 'torch', path: tuple = ()
                     ) -> tuple[Any, dict]:
  """(outputs, variables) of `module.init_with_output(key, *inputs)`; with scheme 'torch', its Dense/Conv layers
  redrawn by `torch_default_init` from fold_in(key, 1), each layer keyed by its path under `path` (a module
  initialised on its own with path=('companion',) draws what it would draw as the submodule 'companion' of a
  client). The outputs are those of the module as flax initialised it (before the redraw)."""
  outputs, variables = module.init_with_output(key, *inputs)
  variables = dict(variables)
  if scheme == 'torch':
    params = variables['params']
    for name in reversed(path):
      params = {name: params}
    params = torch_default_init(params, jax.random.fold_in(key, 1))
    for name in path:
      params = params[name]
    variables['params'] = params
  return outputs, variables


def init_variables(module: Any, key: jax.Array, *inputs: Any, scheme: str = 'torch', path: tuple = ()) -> dict:
  """The variables of `init_with_output` (flax's `module.init` draws the same)."""
  return init_with_output(module, key, *inputs, scheme=scheme, path=path)[1]
