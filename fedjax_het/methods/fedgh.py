"""FedGH (Yi et al., ACM MM 2023, as run in HtFLlib): a global head trained on the clients' class prototypes.

Each round a participant sets its head to the global head, trains on CE, and uploads its eval-mode class
prototypes. The server trains the global head on the (prototype, class) pairs of all participants with CE
(SGD 0.01, 1 epoch, batches of the local batch size, mean loss over the batch as torch's CrossEntropyLoss) and broadcasts it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax

from fedjax_het.core import FederationSpec, Phase, Traffic, hyperparameter
from fedjax_het.methods.fedproto import prototype_rows, prototype_upload, prototypes_sent
from fedjax_het.methods.shared.base import (Algorithm, HeadServer, global_head_evaluation, initial_head, receive_head,
                                            sgd_program)
from fedjax_het.methods.shared.common import (check_server_training, class_means_privacy, cross_entropy_loss,
                                              head_apply, sgd_on_rows, soft_cross_entropy)


@dataclasses.dataclass(frozen=True)
class FedGHConfig:
  """Server SGD on the prototypes (HtFLlib's script: -slr 0.01 -se 1; batches of the local batch size)."""
  server_learning_rate: float = hyperparameter(0.01, 'Server SGD learning rate.')
  server_batch_size: Optional[int] = hyperparameter(None, 'Server batch size.')  # None: the local batch size
  server_epochs: int = hyperparameter(1, 'Server epochs per round.')

  def __post_init__(self):
    check_server_training(self)


def fedgh(cfg: FedGHConfig, num_classes: int) -> Algorithm:
  """FedGH as an `Algorithm` (the server batch is the run's local batch size, `FederationSpec.training`, when
  cfg.server_batch_size is None)."""

  def client(group):
    return sgd_program(cross_entropy_loss(group.model), group.training, receive=receive_head,
                       upload=prototype_upload(num_classes), representations=True)

  def server_update(spec: FederationSpec):
    """Trains the global head on CE over the participants' (prototype, class) pairs."""
    server_batch = cfg.server_batch_size or spec.training.batch_size
    return lambda server, uploads, key: train_head(server, uploads, key, server_batch)

  def train_head(server, uploads, key, server_batch):
    protos, labels, weight = prototype_rows(uploads.every())
    onehot = jax.nn.one_hot(labels, num_classes)
    row_loss = lambda h, idx: soft_cross_entropy(head_apply(h, protos[idx]), onehot[idx])
    head, loss = sgd_on_rows(server.head, row_loss, weight, key, cfg.server_learning_rate,
                             server_batch, cfg.server_epochs, 'mean')
    return HeadServer(head), {'server_loss': loss}

  def head_sent(broadcast):
    """The head (FedRE Table 11 counts its kernel only)."""
    return {'head_kernel': broadcast.head['kernel'].size, 'head_bias': broadcast.head['bias'].size}

  phase = Phase('fedgh', client, server_update, server_of_spec=True, traffic=Traffic(prototypes_sent, head_sent))
  return Algorithm('fedgh', initial_head, (phase,), global_head_evaluation,
                   upload_privacy=class_means_privacy('protos', 'records'))
