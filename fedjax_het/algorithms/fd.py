"""FD, federated distillation (Jeong et al. 2018; FedDistill in HtFLlib): per-class mean logits.

Clients train on CE + lambda * CE_soft(z_i, softmax(L_{y_i})), pulling each output towards the softened global
mean logit of its class, and upload their per-class mean logits (eval mode, own head). The server averages each
class's logits over the clients that hold it. SPEC.md follows the paper's cross-entropy to the averaged output;
HtFLlib's FedDistill uses MSE(z_i, L_{y_i}) instead. Rows whose class has no global logit add nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from fedjax_het.algorithms.base import Algorithm, CommSpec, identity_broadcast, keep_client, local_head
from fedjax_het.algorithms.common import aggregate_class_means, class_prototypes, head_apply, soft_cross_entropy
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
    return ce + cfg.lamda * distillation_term(logits, y, broadcast['logits'], broadcast['present']), model_state

  def client_upload(client: ClientState, reps, y, n, broadcast, rng, num_train):
    means, counts = class_prototypes(head_apply(client.params['head'], reps), y, jnp.arange(y.shape[0]) < n,
                                     num_classes)
    return {'logits': means, 'counts': counts}

  def server_update(server, uploads, mask, rng):
    logits, present = aggregate_class_means(uploads['logits'], uploads['counts'], mask)
    return {'logits': logits, 'present': present}, {'global_classes': present.sum()}

  def communication(spec: CommSpec):
    return {'upload': {'logits': spec.num_present_classes * spec.num_classes},
            'broadcast': {'logits': spec.num_classes * spec.num_classes}}

  return Algorithm('fd', init_server, identity_broadcast, keep_client, client_loss, client_upload, server_update,
                   local_head, communication)
