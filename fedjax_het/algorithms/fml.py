"""FML, federated mutual learning (Shen et al. 2020, as run in HtFLlib): a shared global model beside each local one.

Every client trains its own (heterogeneous) model and a copy of a shared small model (the "meme", HtFLlib's
4-layer CNN; `global_model`) on one loss per batch,
  L = alpha CE(y, p) + (1 - alpha) KL(p_g || p) + beta CE(y, p_g) + (1 - beta) KL(p || p_g),
with p, p_g the two models' softmax outputs; both models take the gradient of L. As in HtFLlib (torch's
KLDivLoss(reduction='mean')), each KL is averaged over batch and classes, and neither side is detached; HtFLlib
also clips each model's gradient norm at 10, which is not done here. The server averages the participants'
global models unweighted (HtFLlib `serverfml.py`: each with weight 1/len(uploaded_ids)) and broadcasts the average;
clients are scored with their own model.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import optax

from fedjax_het.algorithms.base import Algorithm, identity_broadcast, local_head
from fedjax_het.algorithms.common import elementwise_kl, participant_average
from fedjax_het.algorithms.global_model import (check_global_model, global_model_communication,
                                                initial_global_model, receive_global_model)
from fedjax_het.engine.forward import forward
from fedjax_het.engine.state import ClientState
from fedjax_het.errors import ConfigError
from fedjax_het.models.classifier import Companion, HeteroClassifier


@dataclasses.dataclass(frozen=True)
class FMLConfig:
  """alpha, beta: CE weights of the local and the global model (0.5 each); global_model: its architecture."""
  alpha: float = 0.5
  beta: float = 0.5
  global_model: str = 'cnn4'

  def __post_init__(self):
    if not (0 <= self.alpha <= 1 and 0 <= self.beta <= 1):
      raise ConfigError(f'FML: --fml_alpha ({self.alpha}) and --fml_beta ({self.beta}) must be in [0, 1].')


def mutual_loss(logits: jnp.ndarray, global_logits: jnp.ndarray, y: jnp.ndarray, alpha: float, beta: float
                ) -> jnp.ndarray:
  """L of the module docstring for one batch."""
  ce = lambda z: optax.softmax_cross_entropy_with_integer_labels(z, y).mean()
  return (alpha * ce(logits) + (1 - alpha) * elementwise_kl(global_logits, logits)
          + beta * ce(global_logits) + (1 - beta) * elementwise_kl(logits, global_logits))


def fml(cfg: FMLConfig, num_classes: int) -> Algorithm:
  """FML as an `Algorithm` (its clients' models carry `cfg.global_model` as their companion)."""
  check_global_model(cfg.global_model, 'FML')

  def client_loss(model, params, model_state, x, y, broadcast, rng):
    logits, _, model_state = forward(model, params, model_state, x, train=True)
    global_logits, _, model_state = forward(model, params, model_state, x, True, HeteroClassifier.companion_forward)
    return mutual_loss(logits, global_logits, y, cfg.alpha, cfg.beta), model_state

  def client_upload(client: ClientState, reps, y, n, broadcast, rng, num_train):
    return {'companion': client.params['companion']}

  def server_update(server, uploads, mask, rng):
    return {'companion': participant_average(uploads['companion'], mask.astype(jnp.float32),
                                             server['companion'])}, {}

  return Algorithm('fml', initial_global_model, identity_broadcast, receive_global_model, client_loss,
                   client_upload, server_update, local_head, global_model_communication,
                   needs_representations=False, companion=Companion(cfg.global_model))
