"""FD, federated distillation (Jeong et al. 2018; FedDistill in HtFLlib): per-class mean logits.

Clients train on CE + lambda * CE_soft(z_i, softmax(L_{y_i})), pulling each output towards the softened global
mean logit of its class, and upload their per-class mean logits, gathered as HtFLlib gathers them: from the
training-mode outputs of every real local step (`train_statistics`). The server averages each class's logits over
the clients that hold it, unweighted. Rows whose class has no global logit add nothing.

Which distillation term: HtFLlib's FedDistill used MSE(z_i, L_{y_i}) until 2024-03, CE to softmax(L_{y_i})
from then until 2025-11, and since then CE with the raw global logits L_{y_i} as the target (torch's
CrossEntropyLoss with a float target; rows of classes without a global logit then target their own detached
logits). This module implements the middle one, CE to softmax(L_{y_i}), which is the paper's distillation to the
averaged output as a distribution.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_het.core import Traffic, hyperparameter
from fedjax_het.errors import ConfigError, setting
from fedjax_het.methods.shared.base import Algorithm, local_head_evaluation, one_phase, sgd_program
from fedjax_het.methods.shared.common import (class_means_from_sums, class_means_privacy, class_sums, cross_entropy,
                                              soft_cross_entropy, train_forward)


@dataclasses.dataclass(frozen=True)
class FDConfig:
  """lamda: weight of the distillation term (1)."""
  lamda: float = hyperparameter(1.0, 'Weight of the regulariser (prototype MSE, distillation).')

  def __post_init__(self):
    if self.lamda < 0:
      raise ConfigError(f'{setting(self, "lamda")} must be >= 0.')


def distillation_term(logits: jnp.ndarray, labels: jnp.ndarray, global_logits: jnp.ndarray, present: jnp.ndarray
                      ) -> jnp.ndarray:
  """Mean over the batch of CE_soft(z_i, softmax(L_{y_i})), 0 for rows whose class has no global logit."""
  target = jax.nn.softmax(global_logits[labels], axis=-1)
  return jnp.mean(present[labels] * soft_cross_entropy(logits, target))


class ClassLogits(NamedTuple):
  """FD's global logits as the server holds and broadcasts them: logits [C, C], row c the mean logit vector of
  class c; present [C], whether class c has one."""
  logits: jnp.ndarray
  present: jnp.ndarray


class LogitUpload(NamedTuple):
  """A client's per-class mean logits [C, C] and its rows per class, counts [C]."""
  logits: jnp.ndarray
  counts: jnp.ndarray


def fd(cfg: FDConfig, num_classes: int) -> Algorithm:
  """FD as an `Algorithm`."""

  def init_server(key, spec, initial):
    return ClassLogits(jnp.zeros((num_classes, num_classes)), jnp.zeros(num_classes, bool))

  def client(group):
    def loss(client, batch, broadcast, key):
      logits, _, client = train_forward(group.model, client, batch.x)
      value = cross_entropy(logits, batch.y) + cfg.lamda * distillation_term(logits, batch.y, broadcast.logits,
                                                                             broadcast.present)
      return value, (client, class_sums(logits, batch.y, num_classes))

    def upload(client, rows, broadcast, key):
      return LogitUpload(*class_means_from_sums(rows.statistics))

    zeros = lambda c: (jnp.zeros((num_classes, num_classes)), jnp.zeros(num_classes))
    return sgd_program(loss, group.training, upload=upload, statistics=zeros)

  def server_update(server, uploads, key):
    logits, present = uploads.class_mean('logits')
    return ClassLogits(logits, present), {'global_classes': present.sum()}

  return one_phase('fd', init_server, client, server_update, local_head_evaluation,
                   traffic=Traffic(lambda u: {'logits': jnp.sum(u.counts > 0) * num_classes},
                                   lambda b: {'logits': b.logits.size}),
                   upload_privacy=class_means_privacy('logits'))
