"""Every local model is `extractor -> RM (map to width d) -> head (d -> C)` (SPEC.md, "RM")."""

from __future__ import annotations

import dataclasses
from typing import Optional

import flax.linen as nn
import jax.numpy as jnp

from fedjax_het.errors import ConfigError
from fedjax_het.models.pooling import adaptive_avg_pool1d, adaptive_max_pool1d

RM_MODES = ('ap', 'mp', 'fc')
COMPANION_LINKS = ('hidden_map', 'fusion')


@dataclasses.dataclass(frozen=True)
class Companion:
  """A model every client trains beside its own (FML's, FedKD's and FedMRL's shared global model).

  arch: its registered architecture; feature_dim: its RM width (None: the client's d); link: an optional
  client-local layer tying the two models, which stays on the client:
    'hidden_map': FedKD's W_h, a bias-free Dense(d) from the companion's representation to the client's;
    'fusion': FedMRL's proj, Dense(d) over [companion representation, client representation]; the client's head,
      its representation passes and its evaluation then use this fused representation.
  """
  arch: str
  feature_dim: Optional[int] = None
  link: Optional[str] = None

  def __post_init__(self):
    if self.link is not None and self.link not in COMPANION_LINKS:
      raise ConfigError(f'Companion link {self.link!r} is unknown; choose one of {", ".join(COMPANION_LINKS)}.')


class HeteroClassifier(nn.Module):
  """A classifier split into a heterogeneous extractor, an RM step to `feature_dim`, and a shared-shape head.

  The extractor maps x [B, ...] to a feature map [B, H, W, L] or a vector [B, L]. RM:
    ap: mean over spatial positions, then adaptive average pooling of the L channels to d (PyTorch bin rule);
    mp: max over spatial positions, then adaptive max pooling to d;
    fc: mean over spatial positions, then a learned Dense(L -> d) that belongs to the extractor.
  The head is `Dense(num_classes)` named 'head', so its parameters have the same pytree in every architecture.

  `companion`: an optional second classifier trained alongside (e.g. FML's shared global model); its parameters
  live under 'companion' and have the same pytree in every architecture group. `companion_link` ('hidden_map' or
  'fusion', see `Companion`) adds the client-local layer of that name.
  """
  extractor: nn.Module
  num_classes: int
  feature_dim: int = 512
  rm: str = 'ap'
  companion: Optional[nn.Module] = None
  companion_link: Optional[str] = None

  def setup(self):
    if self.rm not in RM_MODES:
      raise ConfigError(f'--rm={self.rm!r} is unknown; choose one of {", ".join(RM_MODES)}.')
    if self.rm == 'fc':
      self.rm_fc = nn.Dense(self.feature_dim, name='rm_fc')
    self.head = nn.Dense(self.num_classes, name='head')
    if self.companion_link == 'hidden_map':
      self.hidden_map = nn.Dense(self.feature_dim, use_bias=False, name='hidden_map')
    elif self.companion_link == 'fusion':
      self.fusion = nn.Dense(self.feature_dim, name='fusion')

  def represent(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    """The mapped representation r = RM(g(x)) [B, d]."""
    h = self.extractor(x, train=train)
    if h.ndim > 2:
      spatial = tuple(range(1, h.ndim - 1))
      h = h.max(axis=spatial) if self.rm == 'mp' else h.mean(axis=spatial)
    if self.rm == 'fc':
      return self.rm_fc(h)
    if self.rm == 'mp':
      return adaptive_max_pool1d(h, self.feature_dim)
    return adaptive_avg_pool1d(h, self.feature_dim)

  def classify(self, r: jnp.ndarray) -> jnp.ndarray:
    """Head logits f(omega; r) [B, C]."""
    return self.head(r)

  def companion_forward(self, x: jnp.ndarray, train: bool = False) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The companion's (logits, representation)."""
    return self.companion(x, train)

  def companion_classify(self, r: jnp.ndarray) -> jnp.ndarray:
    """The companion's head applied to r [B, d_c] (FedMRL: the first d_c entries of the fused representation)."""
    return self.companion.classify(r)

  def map_companion_representation(self, r_companion: jnp.ndarray) -> jnp.ndarray:
    """FedKD's W_h r_g [B, d]: the companion's representation mapped to the client's width."""
    return self.hidden_map(r_companion)

  def __call__(self, x: jnp.ndarray, train: bool = False) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(logits [B, C], representation [B, d]); with the 'fusion' link the representation is
    fusion([r_companion, r]) (FedMRL); initialisation also creates the companion's and the link's parameters."""
    r = self.represent(x, train)
    if self.companion_link == 'fusion':
      _, r_companion = self.companion(x, train)
      r = self.fusion(jnp.concatenate([r_companion, r], axis=-1))
    elif self.companion is not None and self.is_initializing():
      _, r_companion = self.companion(x, train)
      if self.companion_link == 'hidden_map':
        self.hidden_map(r_companion)
    return self.classify(r), r

