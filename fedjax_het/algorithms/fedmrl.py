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
because it never saves the trained one (SPEC.md), which is not reproduced.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import optax

from fedjax_het.algorithms.base import Algorithm, identity_broadcast, local_head
from fedjax_het.algorithms.common import participant_average
from fedjax_het.algorithms.global_model import (check_global_model, global_model_communication,
                                                initial_global_model, receive_global_model)
from fedjax_het.engine.forward import forward
from fedjax_het.engine.state import ClientState
from fedjax_het.errors import ConfigError
from fedjax_het.models.classifier import Companion, HeteroClassifier


@dataclasses.dataclass(frozen=True)
class FedMRLConfig:
  """sub_feature_dim: width d_c of the global model's representation (HtFLlib: 128); global_model: its
  architecture."""
  sub_feature_dim: int = 128
  global_model: str = 'cnn4'

  def __post_init__(self):
    if self.sub_feature_dim < 1:
      raise ConfigError(f'--sub_feature_dim={self.sub_feature_dim} must be >= 1.')


def matryoshka_loss(logits: jnp.ndarray, global_logits: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
  """CE(head(r), y) + CE(head_g(r[:d_c]), y), each averaged over the batch."""
  ce = lambda z: optax.softmax_cross_entropy_with_integer_labels(z, y).mean()
  return ce(logits) + ce(global_logits)


def fedmrl(cfg: FedMRLConfig, num_classes: int, feature_dim: int) -> Algorithm:
  """FedMRL as an `Algorithm` (clients carry the global model as a companion fused through proj)."""
  check_global_model(cfg.global_model, 'FedMRL')
  if cfg.sub_feature_dim > feature_dim:
    raise ConfigError(f'--sub_feature_dim={cfg.sub_feature_dim} must be <= --feature_dim={feature_dim}: the '
                      f'global head reads the first sub_feature_dim entries of the fused representation.')

  def client_loss(model, params, model_state, x, y, broadcast, rng):
    logits, fused, model_state = forward(model, params, model_state, x, train=True)
    global_logits = model.apply({'params': params}, fused[:, :cfg.sub_feature_dim],
                                method=HeteroClassifier.companion_classify)
    return matryoshka_loss(logits, global_logits, y), model_state

  def client_upload(client: ClientState, reps, y, n, broadcast, rng, num_train):
    return {'companion': client.params['companion']}

  def server_update(server, uploads, mask, rng):
    return {'companion': participant_average(uploads['companion'], mask.astype(jnp.float32),
                                             server['companion'])}, {}

  return Algorithm('fedmrl', initial_global_model, identity_broadcast, receive_global_model, client_loss,
                   client_upload, server_update, local_head, global_model_communication,
                   needs_representations=False,
                   companion=Companion(cfg.global_model, cfg.sub_feature_dim, link='fusion'),
                   eval_client=receive_global_model)
