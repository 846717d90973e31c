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

import jax.numpy as jnp
import optax

from fedjax_het.algorithms.base import Algorithm, CommSpec, identity_broadcast, keep_client
from fedjax_het.algorithms.common import (aggregate_class_means, class_means_from_sums, class_prototypes,
                                          class_sums, nearest_prototype_head, prototype_regularizer)
from fedjax_het.engine.forward import forward
from fedjax_het.engine.state import ClientState
from fedjax_het.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class FedProtoConfig:
  """lamda: weight of the prototype MSE (HtFLlib's tuned scripts: 10)."""
  lamda: float = 10.0

  def __post_init__(self):
    if self.lamda < 0:
      raise ConfigError(f'--lamda={self.lamda} must be >= 0.')


def prototype_loss(lamda: float, num_classes: int = 0):
  """client_loss of FedProto and FedTGP: CE + lamda * prototype_regularizer to broadcast['protos']; with
  `num_classes`, it also returns the batch's per-class representation sums (FedProto's training-pass prototypes)."""
  def client_loss(model, params, model_state, x, y, broadcast, rng):
    logits, reps, model_state = forward(model, params, model_state, x, train=True)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    loss = ce + lamda * prototype_regularizer(reps, y, broadcast['protos'], broadcast['present'])
    return loss, ((model_state, class_sums(reps, y, num_classes)) if num_classes else model_state)
  return client_loss


def prototype_upload(num_classes: int):
  """client_upload of FedTGP and FedGH: {'protos': [C, d] class means of the eval-mode reps, 'counts': [C]}."""
  def client_upload(client: ClientState, reps, y, n, broadcast, rng, num_train):
    protos, counts = class_prototypes(reps, y, jnp.arange(y.shape[0]) < n, num_classes)
    return {'protos': protos, 'counts': counts}
  return client_upload


def training_pass_prototype_upload(client: ClientState, sums, y, n, broadcast, rng, num_train):
  """client_upload of FedProto: the class means of the training-pass representations summed by the engine."""
  protos, counts = class_means_from_sums(sums)
  return {'protos': protos, 'counts': counts}


def prototype_rows(uploads: dict, mask: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
  """Uploaded prototypes as server training rows (FedGH, FedTGP): (protos [K*C, d], labels [K*C], weight [K*C]),
  weight 1 for each class a participant holds and 0 otherwise."""
  k, c, d = uploads['protos'].shape
  weight = ((uploads['counts'] > 0) & mask[:, None].astype(bool)).astype(jnp.float32).reshape(k * c)
  return uploads['protos'].reshape(k * c, d), jnp.tile(jnp.arange(c), k), weight


def prototype_heads(client: ClientState, broadcast) -> dict:
  """Reported: nearest global prototype; also logged: the client's own head."""
  return {'prototype': nearest_prototype_head(broadcast['protos'], broadcast['present']),
          'local_head': client.params['head']}


def prototype_communication(spec: CommSpec) -> dict:
  """Upload one d-vector per class held; broadcast C global prototypes (FedRE Table 11)."""
  return {'upload': {'prototypes': spec.num_present_classes * spec.feature_dim},
          'broadcast': {'prototypes': spec.num_classes * spec.feature_dim}}


def empty_prototypes(num_classes: int, feature_dim: int) -> dict:
  """No global prototype yet: the regularizer is 0 until the first server update."""
  return {'protos': jnp.zeros((num_classes, feature_dim)), 'present': jnp.zeros(num_classes, bool)}


def fedproto(cfg: FedProtoConfig, num_classes: int) -> Algorithm:
  """FedProto as an `Algorithm`."""

  def init_server(rng, example_params):
    return empty_prototypes(num_classes, example_params['head']['kernel'].shape[0])

  def server_update(server, uploads, mask, rng):
    """Per-class unweighted mean over the participants holding the class; classes nobody uploaded this round
    have no global prototype next round (as in HtFLlib)."""
    protos, present = aggregate_class_means(uploads['protos'], uploads['counts'], mask)
    return {'protos': protos, 'present': present}, {'global_classes': present.sum()}

  return Algorithm('fedproto', init_server, identity_broadcast, keep_client, prototype_loss(cfg.lamda, num_classes),
                   training_pass_prototype_upload, server_update, prototype_heads, prototype_communication,
                   needs_representations=False, train_statistics=True)
