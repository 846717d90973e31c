"""Every local model is `extractor -> RM (map to width d) -> head (d -> C)`."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from fedjax_het.errors import ConfigError
from fedjax_het.models.layers import Dense
from fedjax_het.models.pooling import adaptive_avg_pool1d, adaptive_max_pool1d

RM_MODES = ('ap', 'mp', 'fc', 'none')
PRECISIONS = ('float32', 'bfloat16')


class HeteroClassifier(nn.Module):
  """A classifier split into a heterogeneous extractor, an RM step to `feature_dim`, and a shared-shape head.

  The extractor maps x [B, ...] to a feature map [B, H, W, L] or a vector [B, L]. RM:
    ap: mean over spatial positions, then adaptive average pooling of the L channels to d (PyTorch bin rule);
    mp: max over spatial positions, then adaptive max pooling to d;
    fc: mean over spatial positions, then a learned Dense(L -> d) that belongs to the extractor;
    none: the extractor's L features as they are (mean over spatial positions of a map), the head Dense(L -> C)
      straight on them, as GeFL's CNNs end in one fc (d is then L, `feature_width`).
  The head is `Dense(num_classes)` named 'head', so its parameters have the same pytree in every architecture (and,
  except under 'none', the same shapes).
  """
  extractor: nn.Module
  num_classes: int
  feature_dim: int = 512
  rm: str = 'ap'
  # 'bfloat16': `models.forward` computes in bfloat16 from float32 parameters (the master copy), outputs in float32.
  precision: str = 'float32'

  def setup(self):
    if self.rm not in RM_MODES:
      raise ConfigError(f'ModelConfig.rm={self.rm!r} is unknown; choose one of {", ".join(RM_MODES)}.')
    if self.rm == 'fc':
      self.rm_fc = Dense(self.feature_dim, name='rm_fc')
    self.head = Dense(self.num_classes, name='head')

  def represent(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    """The mapped representation r = RM(g(x)) [B, d]."""
    return self.features_of(self.extractor(x, train=train))

  def features_of(self, h: jnp.ndarray) -> jnp.ndarray:
    """RM(h) [B, d]: the representation of an extractor output h (a map [B, H, W, L] or a vector [B, L])."""
    if h.ndim > 2:
      spatial = tuple(range(1, h.ndim - 1))
      h = h.max(axis=spatial) if self.rm == 'mp' else h.mean(axis=spatial)
    if self.rm == 'fc':
      return self.rm_fc(h)
    if self.rm == 'mp':
      return adaptive_max_pool1d(h, self.feature_dim)
    if self.rm == 'none':
      return h
    return adaptive_avg_pool1d(h, self.feature_dim)

  def classify(self, r: jnp.ndarray) -> jnp.ndarray:
    """Head logits f(omega; r) [B, C]."""
    return self.head(r)

  def __call__(self, x: jnp.ndarray, train: bool = False) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(logits [B, C], representation [B, d])."""
    r = self.represent(x, train)
    return self.classify(r), r
