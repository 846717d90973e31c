"""FedMRL, federated model heterogeneous Matryoshka representation learning (Yi et al., NeurIPS 2024, as run in
HtFLlib): a shared small global model whose representation is fused with the client's own.

Each client holds its own model (extractor -> RM to d, head d -> C), a copy of the global model (a small
extractor with RM to d_c = 128, head d_c -> C; `global_model`, HtFLlib's 4-layer CNN) and a local projection
  proj: R^{d_c + d} -> R^d,  r = proj([r_g, r_own])   (640 -> 512 by default).
Its loss per batch is CE(head(r), y) + CE(head_g(r[:d_c]), y): the first d_c entries of the fused
representation are the coarse, shared-granularity one the global head reads (the Matryoshka nesting); all three
parts take the gradient. The server averages the participants' global models, unweighted (HtFLlib), and
broadcasts the average. A client is scored with head(proj([r_g, r_own])) using the broadcast global model (HtFLlib
loads the server's copy to test).

proj stays on the client across rounds, as the paper describes; HtFLlib reloads a fresh proj every round
because it never saves the trained one, which is not reproduced.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
import optax

from fedjax_het.core import hyperparameter
from fedjax_het.errors import ConfigError, setting
from fedjax_het.methods.shared.base import Algorithm, ClientState, Evaluation, one_phase, sgd_program
from fedjax_het.methods.shared.common import head_apply
from fedjax_het.methods.shared.global_model import (GLOBAL_MODEL_PRIVACY, average_global_models, check_global_model,
                                                    global_model_forward, init_global_model, initial_global_model,
                                                    receive_global_model, upload_global_model)
from fedjax_het.models.classifier import HeteroClassifier


@dataclasses.dataclass(frozen=True)
class FedMRLConfig:
  """sub_feature_dim: width d_c of the global model's representation (HtFLlib: 128); global_model: its
  architecture."""
  sub_feature_dim: int = hyperparameter(128, 'FedMRL: representation width of the global model (the first '
                                        'entries of the fused representation).')
  global_model: str = hyperparameter('cnn4', 'Architecture of the small global model every client trains beside '
                                     'its own.')

  def __post_init__(self):
    if self.sub_feature_dim < 1:
      raise ConfigError(f'{setting(self, "sub_feature_dim")} must be >= 1.')


def matryoshka_loss(logits: jnp.ndarray, global_logits: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
  """CE(head(r), y) + CE(head_g(r[:d_c]), y), each averaged over the batch."""
  ce = lambda z: optax.softmax_cross_entropy_with_integer_labels(z, y).mean()
  return ce(logits) + ce(global_logits)


def fused_forward(model: HeteroClassifier, global_model: HeteroClassifier, client: ClientState, x: jnp.ndarray,
                  train: bool) -> tuple[jnp.ndarray, jnp.ndarray, ClientState]:
  """(logits head(r), fused r = proj([r_g, r_own]), client with updated BatchNorm statistics when `train`)."""
  variables = {'params': client.params, **client.model_state}
  if train and client.model_state:
    own, model_state = model.apply(variables, x, train=True, method=HeteroClassifier.represent,
                                   mutable=list(client.model_state))
    client = client._replace(model_state=dict(model_state))
  else:
    own = model.apply(variables, x, train=train, method=HeteroClassifier.represent)
  _, shared, client = global_model_forward(global_model, client, x, train)
  proj = client.extra.params['fusion']
  fused = jnp.concatenate([shared, own], axis=-1) @ proj['kernel'] + proj['bias']
  return head_apply(client.params['head'], fused), fused, client


def fedmrl(cfg: FedMRLConfig, num_classes: int, feature_dim: int) -> Algorithm:
  """FedMRL as an `Algorithm` (clients carry the global model and proj in their per-client state)."""
  check_global_model(cfg)
  if cfg.sub_feature_dim > feature_dim:
    raise ConfigError(f'{setting(cfg, "sub_feature_dim")} must be <= ModelConfig.feature_dim={feature_dim}: the '
                      f'global head reads the first sub_feature_dim entries of the fused representation.')

  def init_client(group, key):
    extra = init_global_model(group, group.build_model(cfg.global_model, cfg.sub_feature_dim), key)
    fusion = group.init_module(nn.Dense(group.feature_dim), key,
                               jnp.zeros((1, cfg.sub_feature_dim + group.feature_dim)), name='fusion')['params']
    return extra._replace(params={**extra.params, 'fusion': fusion})

  def client(group):
    global_model = group.build_model(cfg.global_model, cfg.sub_feature_dim)

    def loss(client, batch, broadcast, key):
      logits, fused, client = fused_forward(group.model, global_model, client, batch.x, True)
      global_logits = head_apply(client.extra.params['companion']['head'], fused[:, :cfg.sub_feature_dim])
      return matryoshka_loss(logits, global_logits, batch.y), client
    return sgd_program(loss, group.training, receive=receive_global_model, upload=upload_global_model)

  def evaluation(group):
    """head(proj([r_g, r_own])) with the broadcast global model (HtFLlib loads the server's copy to test)."""
    global_model = group.build_model(cfg.global_model, cfg.sub_feature_dim)
    prepare = lambda client, broadcast: receive_global_model(client, broadcast)
    logits = lambda client, x: (fused_forward(group.model, global_model, client, x, False)[0],)
    return Evaluation(('local_head',), prepare, logits)

  return one_phase('fedmrl', initial_global_model, client, average_global_models, evaluation,
                   init_client=init_client, upload_privacy=GLOBAL_MODEL_PRIVACY)
