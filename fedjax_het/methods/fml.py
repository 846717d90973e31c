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

from fedjax_het.core import hyperparameter
from fedjax_het.errors import ConfigError, setting
from fedjax_het.methods.shared.base import Algorithm, local_head_evaluation, one_phase, sgd_program
from fedjax_het.methods.shared.common import elementwise_kl, train_forward
from fedjax_het.methods.shared.global_model import (GLOBAL_MODEL_PRIVACY, average_global_models, check_global_model,
                                                    global_model_forward, init_global_model, initial_global_model,
                                                    receive_global_model, upload_global_model)


@dataclasses.dataclass(frozen=True)
class FMLConfig:
  """alpha, beta: CE weights of the local and the global model (0.5 each); global_model: its architecture."""
  alpha: float = hyperparameter(0.5, 'FML: CE weight of the local model (1 - alpha on its KL).', 'fml_alpha')
  beta: float = hyperparameter(0.5, 'FML: CE weight of the global model (1 - beta on its KL).', 'fml_beta')
  global_model: str = hyperparameter('cnn4', 'Architecture of the small global model every client trains beside '
                                     'its own.')

  def __post_init__(self):
    if not (0 <= self.alpha <= 1 and 0 <= self.beta <= 1):
      raise ConfigError(f'{setting(self, "alpha")} and {setting(self, "beta")} must be in [0, 1].')


def mutual_loss(logits: jnp.ndarray, global_logits: jnp.ndarray, y: jnp.ndarray, alpha: float, beta: float
                ) -> jnp.ndarray:
  """L of the module docstring for one batch."""
  ce = lambda z: optax.softmax_cross_entropy_with_integer_labels(z, y).mean()
  return (alpha * ce(logits) + (1 - alpha) * elementwise_kl(global_logits, logits)
          + beta * ce(global_logits) + (1 - beta) * elementwise_kl(logits, global_logits))


def fml(cfg: FMLConfig, num_classes: int) -> Algorithm:
  """FML as an `Algorithm` (each client carries a copy of `cfg.global_model` in its per-client state)."""
  check_global_model(cfg)

  def client(group):
    global_model = group.build_model(cfg.global_model)

    def loss(client, batch, broadcast, key):
      logits, _, client = train_forward(group.model, client, batch.x)
      global_logits, _, client = global_model_forward(global_model, client, batch.x)
      return mutual_loss(logits, global_logits, batch.y, cfg.alpha, cfg.beta), client
    return sgd_program(loss, group.training, receive=receive_global_model, upload=upload_global_model)

  init_client = lambda group, key: init_global_model(group, group.build_model(cfg.global_model), key)
  return one_phase('fml', initial_global_model, client, average_global_models, local_head_evaluation,
                   init_client=init_client, upload_privacy=GLOBAL_MODEL_PRIVACY)
