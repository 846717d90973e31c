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

import jax
import jax.numpy as jnp
import optax

from fedjax_het.algorithms.base import Algorithm, CommSpec, identity_broadcast, keep_client, local_head
from fedjax_het.algorithms.common import (aggregate_class_means, class_means_from_sums, class_sums,
                                          soft_cross_entropy)
from fedjax_het.engine.forward import forward
from fedjax_het.engine.state import ClientState
from fedjax_het.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class FDConfig:
  """lamda: weight of the distillation term (1)."""
  lamda: float = 1.0

  def __post_init__(self):
    if self.lamda < 0:
      raise ConfigError(f'--lamda={self.lamda} must be >= 0.')


def distillation_term(logits: jnp.ndarray, labels: jnp.ndarray, global_logits: jnp.ndarray, present: jnp.ndarray
                      ) -> jnp.ndarray:
  """Mean over the batch of CE_soft(z_i, softmax(L_{y_i})), 0 for rows whose class has no global logit."""
  target = jax.nn.softmax(global_logits[labels], axis=-1)
  return jnp.mean(present[labels] * soft_cross_entropy(logits, target))


def fd(cfg: FDConfig, num_classes: int) -> Algorithm:
  """FD as an `Algorithm`."""

  def init_server(rng, example_params):
    return {'logits': jnp.zeros((num_classes, num_classes)), 'present': jnp.zeros(num_classes, bool)}

  def client_loss(model, params, model_state, x, y, broadcast, rng):
    logits, _, model_state = forward(model, params, model_state, x, train=True)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    loss = ce + cfg.lamda * distillation_term(logits, y, broadcast['logits'], broadcast['present'])
    return loss, (model_state, class_sums(logits, y, num_classes))

  def client_upload(client: ClientState, sums, y, n, broadcast, rng, num_train):
    means, counts = class_means_from_sums(sums)
    return {'logits': means, 'counts': counts}

  def server_update(server, uploads, mask, rng):
    logits, present = aggregate_class_means(uploads['logits'], uploads['counts'], mask)
    return {'logits': logits, 'present': present}, {'global_classes': present.sum()}

  def communication(spec: CommSpec):
    return {'upload': {'logits': spec.num_present_classes * spec.num_classes},
            'broadcast': {'logits': spec.num_classes * spec.num_classes}}

  return Algorithm('fd', init_server, identity_broadcast, keep_client, client_loss, client_upload, server_update,
                   local_head, communication, needs_representations=False, train_statistics=True)
