"""FedALA (Zhang et al. 2023, "FedALA: Adaptive local aggregation for personalized federated learning"), within
each architecture group as GeFL's Table II runs its model-homogeneous baselines ("GeFL: Model-Agnostic Federated
Learning with Generative Models", Sec. V: FedAvg, FedProx and FedALA "applied in grouped settings").

Before its local training a participant aggregates its group's model into its own (adaptive local aggregation,
ALA, the paper's Eq. 4-6, as PFLlib's `utils/ALA.py` computes it):
  - the lower layers take the group model's values;
  - the head (the last Linear: PFLlib's default of the last two parameter tensors, --layer_idx 2) becomes
      theta = theta_local + (theta_group - theta_local) * W,
    with element-wise weights W in [0, 1] that the client keeps across rounds (ones at first) and learns on a random
    contiguous --fedala_rand_percent share of its rows, in order, in batches of --batch_size (the last one partial,
    PFLlib's loader without shuffle and with drop_last=False; its CE and BatchNorm over its real rows):
      W <- clip(W - eta * grad_theta L * (theta_group - theta_local), 0, 1)
    for one epoch, or at its first aggregation until the standard deviation of its last --fedala_num_pre_loss epoch
    losses (each epoch's last batch) falls below --fedala_threshold;
  - a client whose model equals the group's (every client in the first round) skips ALA.
It then trains with the run's local SGD and uploads its model; the server averages each group's uploads
(sample-weighted, `fedavg.average_group_models`). Each client is scored with its own model.

Choices: the weight-learning loss is CE with the model in training mode whose BatchNorm statistics are discarded
(PFLlib's temporary model); the first aggregation stops after --fedala_max_start_epochs epochs if the losses have not
settled (PFLlib loops until they do); PFLlib compares the first parameter tensor's sum with the global one's to
detect the first round, this module every parameter. PFLlib scores the models ALA makes from the newest global
model before they train; here a client is scored with its model after its last local training (a client's
evaluation has no data to run ALA on), and only a round's participants run ALA (PFLlib runs it on every client
when it sends the global model; with full participation, as GeFL's setting, the two agree). With one client per
group (GeFL's 10-client setting) the group model is that client's own, ALA never runs and FedALA is local
training, as the paper says of its grouped baselines there.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_het.core import Algorithm, Capabilities, ClientRows, ClientState, GroupSpec, hyperparameter, one_phase
from fedjax_het.errors import ConfigError, setting
from fedjax_het.methods.fedavg import (GROUP_MODEL_PRIVACY, average_group_models, group_model, initial_group_models,
                                       upload_model)
from fedjax_het.methods.shared.base import local_head_evaluation, sgd_program, zero_params
from fedjax_het.methods.shared.common import cross_entropy, cross_entropy_loss, train_forward


@dataclasses.dataclass(frozen=True)
class FedALAConfig:
  """FedALA's hyperparameters (PFLlib's defaults)."""
  eta: float = hyperparameter(1.0, 'FedALA: learning rate of the aggregation weights.', flag='fedala_eta')
  rand_percent: int = hyperparameter(80, 'FedALA: percent of the client\'s rows ALA learns its weights on.',
                                     flag='fedala_rand_percent')
  threshold: float = hyperparameter(0.1, 'FedALA: the first aggregation learns until the std of its last '
                                         '--fedala_num_pre_loss epoch losses is below this.',
                                    flag='fedala_threshold')
  num_pre_loss: int = hyperparameter(10, 'FedALA: epoch losses the first aggregation\'s stopping rule reads.',
                                     flag='fedala_num_pre_loss')
  max_start_epochs: int = hyperparameter(200, 'FedALA: at most this many epochs of the first aggregation.',
                                         flag='fedala_max_start_epochs')

  def __post_init__(self):
    if not 0 < self.rand_percent <= 100:
      raise ConfigError(f'{setting(self, "rand_percent")} must be in (0, 100].')
    if self.eta <= 0 or self.threshold < 0 or self.num_pre_loss < 1 or self.max_start_epochs < 1:
      raise ConfigError(f'{setting(self, "eta")} must be > 0, {setting(self, "threshold")} >= 0, '
                        f'{setting(self, "num_pre_loss")} and {setting(self, "max_start_epochs")} >= 1.')


def ala_head(local: dict, group: dict, weights: dict) -> dict:
  """theta_local + (theta_group - theta_local) * W, leaf by leaf (Eq. 5 on the head)."""
  return jax.tree.map(lambda l, g, w: l + (g - l) * w, local, group, weights)


def ala_weight_step(weights: dict, grads: dict, local: dict, group: dict, eta: float) -> dict:
  """W <- clip(W - eta * dL/dtheta * (theta_group - theta_local), 0, 1) (Eq. 6)."""
  return jax.tree.map(lambda w, d, l, g: jnp.clip(w - eta * d * (g - l), 0.0, 1.0), weights, grads, local, group)


def settled(losses: jnp.ndarray, epochs: jnp.ndarray, threshold: float) -> jnp.ndarray:
  """Whether the first aggregation stops: more epochs than the window `losses` [num_pre_loss] holds (its newest
  last) and their population std below `threshold` (np.std)."""
  return (epochs > losses.shape[0]) & (jnp.std(losses) < threshold)


class ALAState(NamedTuple):
  """A client's ALA state, kept across rounds: weights, the learned element-wise weights W of its head;
  started, whether its first (multi-epoch) ALA has run."""
  weights: dict
  started: jnp.ndarray


def adaptive_local_aggregation(model, cfg: FedALAConfig, batch_size: int, client: ClientState, rows: ClientRows,
                               group_params: dict, key: jax.Array) -> ClientState:
  """The client after ALA of the group model `group_params` into its own (module docstring)."""
  local = client.params
  same = jnp.all(jnp.stack([jnp.array_equal(a, b) for a, b in zip(jax.tree.leaves(local),
                                                                   jax.tree.leaves(group_params))]))
  lower = {**group_params, 'head': local['head']}
  size = rows.num_train * cfg.rand_percent // 100  # PFLlib: int(rand_percent / 100 * len(train_data))
  start = jax.random.randint(key, (), 0, rows.num_train - size + 1)
  steps = -(-size // batch_size)  # PFLlib's loader keeps the window's last partial batch (drop_last=False)

  def loss(head, x, y, real):
    logits, _, _ = train_forward(model, client._replace(params={**lower, 'head': head}), x, real)
    return cross_entropy(logits, y, real)

  def batch_step(s, carry):
    weights, _ = carry
    offset = s * batch_size + jnp.arange(batch_size)
    index = jnp.minimum(start + offset, rows.x.shape[0] - 1)
    head = ala_head(local['head'], group_params['head'], weights)
    value, grads = jax.value_and_grad(loss)(head, rows.x[index], rows.y[index], offset < size)
    return ala_weight_step(weights, grads, local['head'], group_params['head'], cfg.eta), value

  def epoch(carry):
    weights, losses, epochs, _ = carry
    weights, last = jax.lax.fori_loop(0, steps, batch_step, (weights, jnp.zeros(())))
    losses = jnp.roll(losses, -1).at[-1].set(last)
    epochs = epochs + 1
    done = client.extra.started | settled(losses, epochs, cfg.threshold) | (epochs >= cfg.max_start_epochs)
    return weights, losses, epochs, done

  weights, _, _, _ = jax.lax.while_loop(lambda c: ~c[3], epoch, (client.extra.weights,
                                                                    jnp.zeros(cfg.num_pre_loss), 0, steps == 0))
  learned = client._replace(params={**lower, 'head': ala_head(local['head'], group_params['head'], weights)},
                            extra=ALAState(weights, jnp.asarray(True)))
  return jax.tree.map(lambda kept, new: jnp.where(same, kept, new), client, learned)


def fedala(cfg: FedALAConfig, num_classes: int) -> Algorithm:
  """FedALA within each architecture group as an `Algorithm`."""

  def init_client(group: GroupSpec, key) -> ALAState:
    return ALAState(jax.tree.map(jnp.ones_like, zero_params(group)['head']), jnp.asarray(False))

  def client(group: GroupSpec):
    def prepare(client, rows, broadcast, key):
      return adaptive_local_aggregation(group.model, cfg, group.training.batch_size, client, rows,
                                        broadcast.model, key)
    program = sgd_program(cross_entropy_loss(group.model), group.training, upload=upload_model)
    return program._replace(prepare=prepare)

  def server_update(server, uploads, key):
    return average_group_models(server, uploads), {}

  return one_phase('fedala', initial_group_models, client, server_update, local_head_evaluation,
                   broadcast=group_model,
                   init_client=init_client,
                   capabilities=Capabilities(partial_batches=True, shares_representations=False),
                   upload_privacy=GROUP_MODEL_PRIVACY)
