"""FedTGP (Zhang et al., AAAI 2024, as run in HtFLlib): trainable global prototypes with an adaptive margin.

Clients are FedProto's (CE + lambda * MSE to the global prototypes; upload class prototypes from an eval-mode pass
after training, as HtFLlib's FedTGP client does; scored by the nearest global prototype). The server owns a prototype generator TGP(c) = W2 ReLU(W1 E[c] + b1) + b2 (an Embedding(C, d)
and a d -> d -> d MLP) and trains it for `server_epochs` epochs over the uploaded (prototype, class) pairs with the
margin-enhanced contrastive loss CE(-(||p - TGP(c')|| + margin * 1[c' = y]), y) (Eq. 4-5), where
margin = min(max_c min_{c' != c} ||mean_c - mean_{c'}||, tau) over this round's per-class mean prototypes (Eq. 6).
It broadcasts TGP(c) for every class, as HtFLlib does.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_het.core import FederationSpec, Phase, Traffic, hyperparameter
from fedjax_het.errors import ConfigError, setting
from fedjax_het.methods.fedproto import (Prototypes, empty_prototypes, global_prototypes_sent, prototype_evaluation,
                                         prototype_loss, prototype_rows, prototype_upload, prototypes_sent)
from fedjax_het.methods.shared.base import Algorithm, sgd_program
from fedjax_het.methods.shared.common import check_server_training, class_means_privacy, sgd_on_rows
from fedjax_het.models.init import torch_default_init
from fedjax_het.models.layers import Dense


@dataclasses.dataclass(frozen=True)
class FedTGPConfig:
  """HtFLlib's script for the HtM10 family: -lam 10 -se 100 -mart 100; server SGD at the *local* learning rate
  (HtFLlib's `servertgp.py` sets server_learning_rate = args.local_learning_rate) in batches of the local batch
  size (its server uses args.batch_size). server_learning_rate / server_batch_size None: those local values.

  hidden_dim: width of TGP's hidden layer (None: d).
  """
  lamda: float = hyperparameter(10.0, 'Weight of the regulariser (prototype MSE, distillation).')
  margin_threshold: float = hyperparameter(100.0, 'FedTGP: upper bound tau of the adaptive margin.')
  server_learning_rate: Optional[float] = hyperparameter(None, 'Server SGD learning rate.')  # None: the local one
  server_batch_size: Optional[int] = hyperparameter(None, 'Server batch size.')  # None: the local batch size
  server_epochs: int = hyperparameter(100, 'Server epochs per round.')
  hidden_dim: Optional[int] = hyperparameter(None, 'FedTGP: width of the generator\'s hidden layer (default d).',
                                             'tgp_hidden_dim')

  def __post_init__(self):
    if self.lamda < 0 or self.margin_threshold < 0:
      raise ConfigError(f'{setting(self, "lamda")} and {setting(self, "margin_threshold")} must be >= 0.')
    check_server_training(self)


class PrototypeGenerator(nn.Module):
  """TGP: class index -> prototype, Embedding(C, d) -> Dense(hidden) -> ReLU -> Dense(d); initialised like
  PyTorch (the embedding N(0, 1) here, the Dense layers by `torch_default_init` in the server's init)."""
  num_classes: int
  feature_dim: int
  hidden_dim: int

  @nn.compact
  def __call__(self, classes: jnp.ndarray) -> jnp.ndarray:
    e = nn.Embed(self.num_classes, self.feature_dim, embedding_init=nn.initializers.normal(1.0))(classes)
    h = nn.relu(Dense(self.hidden_dim)(e))
    return Dense(self.feature_dim)(h)


def adaptive_margin(class_means: jnp.ndarray, present: jnp.ndarray, threshold: float) -> jnp.ndarray:
  """FedTGP Eq. 6: min(max over present classes of the distance to their nearest other present class, tau).

  With fewer than two present classes there is no gap and the margin is tau (HtFLlib's 1e9 placeholder)."""
  sq = jnp.sum((class_means[:, None] - class_means[None]) ** 2, axis=-1)
  dist = jnp.sqrt(jnp.maximum(sq, 0.0))
  pair = present[:, None] & present[None] & ~jnp.eye(present.shape[0], dtype=bool)
  nearest = jnp.min(jnp.where(pair, dist, jnp.inf), axis=1)
  has_partner = pair.any(1)
  max_gap = jnp.where(has_partner.any(), jnp.max(jnp.where(has_partner, nearest, -jnp.inf)), jnp.inf)
  return jnp.minimum(max_gap, threshold)


def margin_contrastive_loss(protos: jnp.ndarray, labels: jnp.ndarray, generated: jnp.ndarray,
                            margin: jnp.ndarray) -> jnp.ndarray:
  """Per-row CE(-(||p_i - TGP(c)|| + margin * 1[c = y_i]), y_i) over classes c (FedTGP Eq. 5)."""
  sq = jnp.sum((protos[:, None] - generated[None]) ** 2, axis=-1)
  dist = jnp.sqrt(jnp.maximum(sq, 1e-12))
  logits = -(dist + margin * jax.nn.one_hot(labels, generated.shape[0]))
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


class FedTGPServer(NamedTuple):
  """FedTGP's server: tgp, the prototype generator's params; the global prototypes it broadcasts
  (`fedproto.Prototypes`)."""
  tgp: dict
  prototypes: Prototypes


def fedtgp(cfg: FedTGPConfig, num_classes: int) -> Algorithm:
  """FedTGP as an `Algorithm` (the server trains at the run's local rate and batch size where cfg leaves them
  None: `FederationSpec.training`)."""
  classes = jnp.arange(num_classes)

  def generator(feature_dim: int) -> PrototypeGenerator:
    return PrototypeGenerator(num_classes, feature_dim, cfg.hidden_dim or feature_dim)

  def init_server(key, spec, initial):
    # One program (eagerly, an op per layer).
    params = jax.jit(lambda k: torch_default_init(generator(spec.feature_dim).init(k, classes)['params'], k))(key)
    return FedTGPServer(params, empty_prototypes(num_classes, spec.feature_dim))

  def broadcast(server: FedTGPServer, group) -> Prototypes:
    return server.prototypes

  def client(group):
    return sgd_program(prototype_loss(group.model, cfg.lamda), group.training,
                       upload=prototype_upload(num_classes), representations=True)

  def server_update(spec: FederationSpec):
    """Trains TGP on the participants' prototypes with the adaptive margin; broadcasts TGP(c) for all c."""
    server_rate = cfg.server_learning_rate or spec.training.learning_rate
    server_batch = cfg.server_batch_size or spec.training.batch_size
    return lambda server, uploads, key: train_generator(server, uploads, key, server_rate, server_batch)

  def train_generator(server, uploads, key, server_rate, server_batch):
    protos, labels, weight = prototype_rows(uploads.every())
    means, present = uploads.class_mean('protos')
    margin = adaptive_margin(means, present, cfg.margin_threshold)
    tgp = generator(protos.shape[-1])
    row_loss = lambda p, idx: margin_contrastive_loss(protos[idx], labels[idx], tgp.apply({'params': p}, classes),
                                                      margin)
    params, loss = sgd_on_rows(server.tgp, row_loss, weight, key, server_rate, server_batch, cfg.server_epochs,
                               'mean')
    generated = Prototypes(tgp.apply({'params': params}, classes), jnp.ones(num_classes, bool))
    return FedTGPServer(params, generated), {'server_loss': loss, 'margin': margin}

  phase = Phase('fedtgp', client, server_update, broadcast, server_of_spec=True,
                traffic=Traffic(prototypes_sent, global_prototypes_sent))
  return Algorithm('fedtgp', init_server, (phase,), prototype_evaluation,
                   upload_privacy=class_means_privacy('protos', 'records'))
