"""FedProx within each architecture group (Li et al. 2020; a baseline of GeFL, "GeFL: Model-Agnostic Federated Learning
with Generative Models", Sec. V, mu = 1e-2): grouped FedAvg whose clients minimise CE + (mu / 2) ||w - w_t||^2, w_t
their group's model at the start of the round.

--fedprox_norm=norm reproduces GeFL's code, whose proximal term is (mu / 2) sum over parameter tensors of
||w - w_t||_2 (a norm per tensor, not squared). Everything else is `fedavg_grouped` (sample-weighted mean per
group, BatchNorm statistics kept by each client)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fedjax_het.core import Capabilities, hyperparameter
from fedjax_het.errors import ConfigError, setting
from fedjax_het.methods.fedavg import (GROUP_MODEL_PRIVACY, average_group_models, group_model, initial_group_models,
                                       receive_group_model, upload_model)
from fedjax_het.methods.shared.base import Algorithm, GroupSpec, head_evaluation, one_phase, own_head, sgd_program
from fedjax_het.methods.shared.common import cross_entropy_loss


@dataclasses.dataclass(frozen=True)
class FedProxConfig:
  """FedProx's hyperparameters."""
  mu: float = hyperparameter(0.01, 'FedProx: weight mu of the proximal term (GeFL\'s baseline: 1e-2).',
                             flag='fedprox_mu')
  norm: str = hyperparameter('squared', "FedProx: 'squared' ((mu/2) ||w - w_t||^2, the paper) or 'norm' ((mu/2) "
                                        "sum of per-tensor ||w - w_t||_2, GeFL's code).", flag='fedprox_norm')

  def __post_init__(self):
    if self.mu < 0 or self.norm not in ('squared', 'norm'):
      raise ConfigError(f'{setting(self, "mu")} must be >= 0 and {setting(self, "norm")} \'squared\' or \'norm\'.')


def proximal_term(params, anchor, norm: str = 'squared') -> jnp.ndarray:
  """sum ||w - w_t||^2 over all parameters ('squared'), or sum over tensors of ||w - w_t||_2 ('norm')."""
  diffs = [jnp.sum((a - b) ** 2) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(anchor))]
  return sum(diffs) if norm == 'squared' else sum(jnp.sqrt(d) for d in diffs)


def fedprox(cfg: FedProxConfig, num_classes: int) -> Algorithm:
  """Grouped FedProx as an `Algorithm`; each participant uploads and receives its whole model."""
  def client(group: GroupSpec):
    ce = cross_entropy_loss(group.model)

    def loss(client, batch, broadcast, key):
      value, updated = ce(client, batch, broadcast, key)
      return value + cfg.mu / 2 * proximal_term(client.params, broadcast.model, cfg.norm), updated
    return sgd_program(loss, group.training, receive=receive_group_model, upload=upload_model)

  def server_update(server, uploads, key):
    return average_group_models(server, uploads), {}

  return one_phase('fedprox', initial_group_models, client, server_update,
                   lambda group: head_evaluation(group.model, {'local_head': own_head}, receive=receive_group_model),
                   broadcast=group_model,
                   capabilities=Capabilities(partial_batches=True, shares_representations=False,
                                             server_model_evaluation=True),
                   upload_privacy=GROUP_MODEL_PRIVACY)
