"""FedProto (Tan et al., AAAI 2022, as run in HtFLlib): class prototypes instead of parameters.

Clients train on CE + lambda * MSE(r_i, P_{y_i}) towards the global prototypes (Eq. 8), then upload their class
prototypes (the mean representation of each class they hold). The server averages each class's prototypes over the
clients that hold it, unweighted (Eq. 6), and broadcasts them. A client is scored by the nearest global prototype
(the paper's test rule); its own head's accuracy is logged too.

Prototypes are gathered where HtFLlib's FedProto gathers them: in the training-mode forward passes of the local
epochs (every real step's batch, each row's representation as the model stood at that step), averaged per class
(`train_statistics`). FedTGP's client instead computes them in an eval-mode pass after training, as HtFLlib's
FedTGP client does (`collect_protos`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp

from fedjax_het.core import Traffic, hyperparameter
from fedjax_het.errors import ConfigError, setting
from fedjax_het.methods.shared.base import (Algorithm, ClientRows, ClientState, Evaluation, GroupSpec, Uploads,
                                            head_evaluation, one_phase, own_head, sgd_program)
from fedjax_het.methods.shared.common import (class_means_from_sums, class_means_privacy, class_prototypes, class_sums,
                                              cross_entropy, nearest_prototype_head, prototype_regularizer,
                                              train_forward)


@dataclasses.dataclass(frozen=True)
class FedProtoConfig:
  """lamda: weight of the prototype MSE (HtFLlib's tuned scripts: 10)."""
  lamda: float = hyperparameter(10.0, 'Weight of the regulariser (prototype MSE, distillation).')

  def __post_init__(self):
    if self.lamda < 0:
      raise ConfigError(f'{setting(self, "lamda")} must be >= 0.')


class Prototypes(NamedTuple):
  """Global prototypes as the server holds and broadcasts them: protos [C, d], present [C] (whether class c has
  one)."""
  protos: jnp.ndarray
  present: jnp.ndarray


class PrototypeUpload(NamedTuple):
  """A client's per-class means: protos [C, d] (0 for a class it does not hold), counts [C] rows per class."""
  protos: jnp.ndarray
  counts: jnp.ndarray


def prototype_loss(model, lamda: float, num_classes: int = 0):
  """The loss of FedProto and FedTGP: CE + lamda * prototype_regularizer to the broadcast `Prototypes`; with
  `num_classes`, it also returns the batch's per-class representation sums (FedProto's training-pass prototypes)."""
  def loss(client, batch, broadcast, key):
    logits, reps, client = train_forward(model, client, batch.x)
    value = cross_entropy(logits, batch.y) + lamda * prototype_regularizer(reps, batch.y, broadcast.protos,
                                                                          broadcast.present)
    return value, ((client, class_sums(reps, batch.y, num_classes)) if num_classes else client)
  return loss


def prototype_upload(num_classes: int):
  """The upload of FedTGP, FedGH and FPL: the class means of the eval-mode representations of the statistics rows
  and their counts (`PrototypeUpload`)."""
  def upload(client: ClientState, rows: ClientRows, broadcast, key) -> PrototypeUpload:
    return PrototypeUpload(*class_prototypes(rows.reps, rows.y, jnp.arange(rows.y.shape[0]) < rows.n, num_classes))
  return upload


def training_pass_prototype_upload(client: ClientState, rows: ClientRows, broadcast, key) -> PrototypeUpload:
  """The upload of FedProto: the class means of the training-pass representations summed over its steps."""
  return PrototypeUpload(*class_means_from_sums(rows.statistics))


def prototype_rows(uploads: Uploads) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
  """Uploaded prototypes (all groups, `RoundUploads.every`) as server training rows (FedGH, FedTGP): (protos [K*C, d],
  labels [K*C], weight [K*C]), weight 1 for each class a participant holds and 0 otherwise."""
  k, c, d = uploads.values.protos.shape
  weight = uploads.holds().astype(jnp.float32).reshape(k * c)
  return uploads.values.protos.reshape(k * c, d), jnp.tile(jnp.arange(c), k), weight


def prototype_evaluation(group: GroupSpec) -> Evaluation:
  """Reported: nearest global prototype; also logged: the client's own head."""
  heads = {'prototype': lambda c, b: nearest_prototype_head(b.protos, b.present), 'local_head': own_head}
  return head_evaluation(group.model, heads)


def prototypes_sent(upload: PrototypeUpload) -> dict:
  """One d-vector per class held (FedRE Table 11); the counts only say which classes, and are not counted."""
  return {'prototypes': jnp.sum(upload.counts > 0) * upload.protos.shape[-1]}


def global_prototypes_sent(broadcast: Prototypes) -> dict:
  """C global prototypes (FedRE Table 11)."""
  return {'prototypes': broadcast.protos.size}


def empty_prototypes(num_classes: int, feature_dim: int) -> Prototypes:
  """No global prototype yet: the regularizer is 0 until the first server update."""
  return Prototypes(jnp.zeros((num_classes, feature_dim)), jnp.zeros(num_classes, bool))


def fedproto(cfg: FedProtoConfig, num_classes: int) -> Algorithm:
  """FedProto as an `Algorithm`."""

  def init_server(key, spec, initial):
    return empty_prototypes(num_classes, spec.feature_dim)

  def client(group: GroupSpec):
    zeros = lambda c: (jnp.zeros((num_classes, group.feature_dim)), jnp.zeros(num_classes))
    return sgd_program(prototype_loss(group.model, cfg.lamda, num_classes), group.training,
                       upload=training_pass_prototype_upload, statistics=zeros)

  def server_update(server, uploads, key):
    """Per-class unweighted mean over the participants holding the class; classes nobody uploaded this round
    have no global prototype next round (as in HtFLlib)."""
    protos, present = uploads.class_mean('protos')
    return Prototypes(protos, present), {'global_classes': present.sum()}

  return one_phase('fedproto', init_server, client, server_update, prototype_evaluation,
                   traffic=Traffic(prototypes_sent, global_prototypes_sent),
                   upload_privacy=class_means_privacy('protos'))
