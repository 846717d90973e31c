"""Grouped FedAvg: FedAvg of the parameters within each architecture group (sample-weighted), no cross-group
exchange. The server keeps one model per group, initialised as the group's clients are (PFLlib broadcasts the
global model before the first local step); each round a participant starts from its group's model and uploads its
trained parameters; the server averages them per group. A client is scored with its group's model. As in PFLlib,
which averages `model.parameters()`, BatchNorm running statistics are not averaged: they stay with each client."""

from __future__ import annotations

from typing import NamedTuple

import jax

from fedjax_het.core import Capabilities, FederationSpec, UploadPrivacy
from fedjax_het.methods.shared.base import (Algorithm, ClientState, GroupSpec, head_evaluation, one_phase, own_head,
                                            sgd_program)
from fedjax_het.methods.shared.common import cross_entropy_loss


class GroupModels(NamedTuple):
  """The server of a method that averages models within each architecture group: one model's params per group,
  in group order."""
  models: tuple


class GroupModel(NamedTuple):
  """What a group's participants receive (the group's model) and each uploads (its trained model): params."""
  model: dict


def initial_group_models(key: jax.Array, spec: FederationSpec, initial) -> GroupModels:
  """Each group's model as its clients start (init_server)."""
  return GroupModels(tuple(state.params for state in initial))


def group_model(server: GroupModels, group: GroupSpec) -> GroupModel:
  """The broadcast: the group's model."""
  return GroupModel(server.models[group.index])


def upload_model(client: ClientState, rows, broadcast, key) -> GroupModel:
  """The upload: the client's trained model."""
  return GroupModel(client.params)


def receive_group_model(client: ClientState, broadcast) -> ClientState:
  """The client's parameters set to its group's model (its BatchNorm statistics stay its own)."""
  return client._replace(params=broadcast.model)


# DP-FedAvg's view of a group-model upload: the delta from the group's model is clipped; the server averages per group
GROUP_MODEL_PRIVACY = UploadPrivacy(reference=lambda b: {'model': b.model}, aggregate='group_sum')


def average_group_models(server: GroupModels, uploads) -> GroupModels:
  """Per group: sum_k n_k theta_k / sum_k n_k over its participants' uploaded models (kept when it had none)."""
  return GroupModels(uploads.group_mean('model', by='rows', previous=server.models))


def fedavg_grouped(num_classes: int) -> Algorithm:
  """Grouped FedAvg as an `Algorithm`; each participant uploads and receives its whole model."""

  def client(group: GroupSpec):
    return sgd_program(cross_entropy_loss(group.model), group.training, receive=receive_group_model,
                       upload=upload_model)

  def server_update(server, uploads, key):
    return average_group_models(server, uploads), {}

  evaluation = lambda group: head_evaluation(group.model, {'local_head': own_head}, receive=receive_group_model)
  return one_phase('fedavg', initial_group_models, client, server_update, evaluation, broadcast=group_model,
                   capabilities=Capabilities(partial_batches=True, shares_representations=False,
                                             server_model_evaluation=True),
                   upload_privacy=GROUP_MODEL_PRIVACY)
