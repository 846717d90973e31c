"""Vision Transformers with torchvision's layout (`vit_b_16` / `vit_b_32`, here for small images such as
image_size=32, as HtFLlib's HtM-img-10 family builds them), without the classification head."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax.numpy as jnp

from fedjax_het.models.layers import Conv, Dense
from fedjax_het.models.repeat import apply_blocks


class EncoderBlock(nn.Module):
  """Pre-norm transformer block: x + MHA(LN(x)); x + MLP(LN(x)) with GELU (exact, as torch's nn.GELU)."""
  num_heads: int
  mlp_dim: int

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    y = nn.LayerNorm(epsilon=1e-6)(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.num_heads)(y, y)
    y = nn.LayerNorm(epsilon=1e-6)(x)
    y = Dense(x.shape[-1])(nn.gelu(Dense(self.mlp_dim)(y), approximate=False))
    return x + y


class VisionTransformer(nn.Module):
  """Patchify (conv patch x patch, stride patch) -> prepend a class token -> add learned position embeddings ->
  `depth` encoder blocks -> LayerNorm; returns the class token [B, hidden] (the input torchvision's head sees).

  The position table has one row per token of the images the model is initialised with (5 for 32x32 images and
  patch 16, torchvision's `vit_b_16(image_size=32)`). scan: the encoder blocks as one scanned block
  (models/repeat.py: the same variables, the numbers up to float32 rounding, less to compile)."""
  patch: int
  hidden: int = 768
  depth: int = 12
  num_heads: int = 12
  mlp_dim: int = 3072
  conv: type = Conv
  scan: bool = False

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    x = self.conv(self.hidden, (self.patch, self.patch), self.patch, padding='VALID')(x)
    b = x.shape[0]
    x = x.reshape(b, -1, self.hidden)
    cls = self.param('class_token', nn.initializers.zeros, (1, 1, self.hidden))
    x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, self.hidden)), x], axis=1)
    pos = self.param('pos_embedding', nn.initializers.normal(0.02), (1, x.shape[1], self.hidden))
    x = x + pos
    make = functools.partial(EncoderBlock, self.num_heads, self.mlp_dim)
    x = apply_blocks(self, make, [f'EncoderBlock_{i}' for i in range(self.depth)], x, scan=self.scan)
    return nn.LayerNorm(epsilon=1e-6)(x)[:, 0]
