"""AvgKD (Afonin and Karimireddy 2022, "Towards model agnostic federated learning using knowledge distillation"),
as GeFL's Table II runs it ("GeFL: Model-Agnostic Federated Learning with Generative Models", Sec. V and Appendix:
"pseudo labels aggregated from the outputs of 10 heterogeneous models").

The first round is plain local training (CE). From the second on, a participant starts from its architecture's
model (the mean of the group's uploads), receives every other architecture's model as well, and trains on soft
targets built from its own rows: its one-hot label together with the other architectures' eval-mode softmax
outputs,
  'average' (the paper's AvgKD): t = (onehot(y) + sum_{j != own} softmax(f_j(x))) / M,  M = number of models;
  'gefl'    (GeFL's code):       t = softmax(onehot(y) + sum_{j != own} softmax(f_j(x))),
with the soft-target CE -sum_c t_c log softmax(z)_c, averaged over the batch, for the run's local epochs of SGD.
It uploads its model (parameters and BatchNorm statistics); the server averages each architecture's uploads
(sample-weighted, `participant_average`: GeFL's code averages uniformly over equal-sized IID shards, where the
two agree). Each client is scored with its architecture's model (GeFL reports each architecture's).

Choices: the teachers are the architectures' models at the start of the round (GeFL's code: `ws_glob[j]`); the
paper's two-agent scheme retrains each agent from scratch every round, GeFL's code (followed) continues from the
group's model. GeFL reports AvgKD's best accuracy within about 30 rounds (its accuracy falls afterwards): the
summary's best accuracy is that figure.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_het.core import (Algorithm, Capabilities, ClientState, GroupSpec, Phase, Traffic, UploadPrivacy,
                             hyperparameter, leaf_scalars)
from fedjax_het.errors import ConfigError, setting
from fedjax_het.methods.shared.base import head_evaluation, own_head, sgd_program
from fedjax_het.methods.shared.common import cross_entropy_loss, soft_cross_entropy, train_forward
from fedjax_het.models.forward import forward
from fedjax_het.rows import batch_mean
from fedjax_het.uploads import RoundUploads

TARGETS = ('average', 'gefl')


@dataclasses.dataclass(frozen=True)
class AvgKDConfig:
  """AvgKD's soft target."""
  target: str = hyperparameter('average', "AvgKD: 'average', the mean of the one-hot label and the other "
                                          "architectures' softmax outputs (the paper); 'gefl', the softmax of their "
                                          "sum (GeFL's code).", flag='avgkd_target')

  def __post_init__(self):
    if self.target not in TARGETS:
      raise ConfigError(f'{setting(self, "target")} is unknown; choose one of {", ".join(TARGETS)}.')


def soft_target(labels: jnp.ndarray, peer_probabilities: jnp.ndarray, num_classes: int, kind: str) -> jnp.ndarray:
  """[B, C] AvgKD's target from the labels [B] and the other models' softmax outputs [M - 1, B, C]: 'average',
  (onehot + their sum) / M; 'gefl', softmax(onehot + their sum)."""
  total = jax.nn.one_hot(labels, num_classes) + peer_probabilities.sum(0)
  if kind == 'average':
    return total / (peer_probabilities.shape[0] + 1)
  return jax.nn.softmax(total, axis=-1)


class GroupStates(NamedTuple):
  """The server of AvgKD and FedDF: each architecture's model, params (models) and BatchNorm statistics
  (model_states), in group order."""
  models: tuple
  model_states: tuple


class GroupState(NamedTuple):
  """A group's model as its participants receive it and each uploads its trained one: params and BatchNorm
  statistics."""
  model: dict
  model_state: dict


class EveryGroupState(NamedTuple):
  """What AvgKD's distillation rounds send: the group's own model and every architecture's (the teachers)."""
  model: dict
  model_state: dict
  models: tuple
  model_states: tuple


def receive_group_state(client: ClientState, broadcast) -> ClientState:
  """The client set to its group's model: parameters and BatchNorm statistics (GeFL's code loads the group's whole
  state dict)."""
  return client._replace(params=broadcast.model, model_state=broadcast.model_state)


def group_state_evaluation(group: GroupSpec):
  """Each client scored with its architecture's model (parameters and BatchNorm statistics)."""
  return head_evaluation(group.model, {'local_head': own_head}, receive=receive_group_state)


def nonnegative_variances(model_state: Any) -> Any:
  """BatchNorm statistics with every running variance clipped at 0 (a mean of noised uploads under DP can fall
  below it; clipping is post-processing, free under DP)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, a: jnp.maximum(a, 0.0) if getattr(path[-1], 'key', None) == 'var' else a, model_state)


def average_group_states(server: GroupStates, uploads: RoundUploads, by: str = 'rows') -> GroupStates:
  """Per architecture, the mean of its participants' parameters and BatchNorm statistics weighted `by` their
  training rows ('rows') or equally ('uniform'); kept when it had none."""
  models = uploads.group_mean('model', by=by, previous=server.models)
  states = tuple(nonnegative_variances(s)
                 for s in uploads.group_mean('model_state', by=by, previous=server.model_states))
  return GroupStates(models, states)


def initial_group_states(key, spec, initial) -> GroupStates:
  """Each architecture's initial model (its clients' shared initialisation)."""
  return GroupStates(tuple(s.params for s in initial), tuple(s.model_state for s in initial))


def own_group_state(server: GroupStates, group: GroupSpec) -> GroupState:
  """The broadcast of a group's own model."""
  return GroupState(server.models[group.index], server.model_states[group.index])


def model_upload(client, rows, broadcast, key) -> GroupState:
  """The client's trained parameters and BatchNorm statistics."""
  return GroupState(client.params, client.model_state)


GROUP_STATE_PRIVACY = UploadPrivacy(reference=lambda b: {'model': b.model, 'model_state': b.model_state},
                                    aggregate='group_sum')


def avgkd(cfg: AvgKDConfig, num_classes: int) -> Algorithm:
  """AvgKD as an `Algorithm`: a round of local training, then rounds of distillation from the other
  architectures' models."""

  def local(group: GroupSpec):
    return sgd_program(cross_entropy_loss(group.model), group.training, receive=receive_group_state,
                       upload=model_upload)

  def distill(group: GroupSpec):
    peers = [j for j in range(len(group.group_models)) if j != group.index]

    def loss(client, batch, broadcast, key):
      logits, _, client = train_forward(group.model, client, batch.x, batch.mask)
      probabilities = jnp.stack([jax.nn.softmax(forward(group.group_models[j], broadcast.models[j],
                                                        broadcast.model_states[j], batch.x, False)[0], -1)
                                 for j in peers]) if peers else jnp.zeros((0,) + logits.shape)
      target = jax.lax.stop_gradient(soft_target(batch.y, probabilities, num_classes, cfg.target))
      return batch_mean(soft_cross_entropy(logits, target), batch.mask), client
    return sgd_program(loss, group.training, receive=receive_group_state, upload=model_upload)

  def server_update(server, uploads, key):
    return average_group_states(server, uploads), {}

  def every_model(server: GroupStates, group) -> EveryGroupState:
    return EveryGroupState(*own_group_state(server, group), server.models, server.model_states)

  def broadcast_scalars(broadcast):
    """What a participant receives: its architecture's model, or in distillation rounds every architecture's
    (its own among them, counted once)."""
    received = ('models', 'model_states') if isinstance(broadcast, EveryGroupState) else ('model', 'model_state')
    return leaf_scalars({k: getattr(broadcast, k) for k in received})

  traffic = Traffic(broadcast=broadcast_scalars)
  phases = (Phase('local', local, server_update, own_group_state, rounds=1, traffic=traffic),
            Phase('distill', distill, server_update, every_model, traffic=traffic))
  return Algorithm('avgkd', initial_group_states, phases, group_state_evaluation,
                   capabilities=Capabilities(partial_batches=True, shares_representations=False,
                                             server_model_evaluation=True),
                   upload_privacy=GROUP_STATE_PRIVACY)
