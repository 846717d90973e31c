"""Grouped FedAvg: FedAvg of the parameters within each architecture group (sample-weighted), no cross-group
exchange. Every client of a group receives its group's average after the round; every group starts from one
model (the engine initialises a group identically for methods with a `group_update`, as PFLlib broadcasts the
global model before the first local step). As in PFLlib, which averages `model.parameters()`, BatchNorm running
statistics are not averaged: they stay with each client."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_het.algorithms.base import (Algorithm, CommSpec, identity_broadcast, keep_client, keep_server,
                                        local_head, no_server, no_upload)
from fedjax_het.algorithms.common import cross_entropy_loss, weighted_average


def group_fedavg(params, model_state, participated: jnp.ndarray, num_train: jnp.ndarray):
  """Model-wise FedAvg inside a group: every client gets sum_k n_k theta_k / sum_k n_k over participants; the
  non-trainable `model_state` (BatchNorm running statistics) is returned unchanged, as PFLlib keeps it local.

  A group without participants this round keeps its clients' parameters.
  """
  weights = participated.astype(jnp.float32) * num_train.astype(jnp.float32)
  any_part = weights.sum() > 0

  def average(tree):
    mean = weighted_average(tree, weights)
    return jax.tree.map(lambda a, m: jnp.where(any_part, jnp.broadcast_to(m, a.shape), a), tree, mean)
  return average(params), model_state


def fedavg_grouped(num_classes: int) -> Algorithm:
  """Grouped FedAvg as an `Algorithm`; each participant uploads and receives its whole model."""

  def communication(spec: CommSpec):
    return {'upload': {'model': spec.num_params}, 'broadcast': {'model': spec.num_params}}

  return Algorithm('fedavg', no_server, identity_broadcast, keep_client, cross_entropy_loss, no_upload,
                   keep_server, local_head, communication, group_update=group_fedavg, needs_representations=False)
