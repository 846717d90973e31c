"""FedMD (Li and Wang 2019, "FedMD: Heterogenous federated learning via model distillation"), as Felo's tables run
it ("Exploiting Features and Logits in Heterogeneous Federated Learning", Sec. 4: the server holds about 10 % of the
training set as public data).

Transfer learning (the run's first round, every client): each client trains on the labelled public set
(--fedmd_transfer_public_epochs, CE), then on its own data (--fedmd_transfer_private_epochs, CE), and uploads its
logits on every public row. Then each round, the participants:
  digest:  train towards the consensus, the unweighted mean of the uploaded public logits, for --fedmd_digest_epochs
           over the public rows (batches of --fedmd_digest_batch_size);
  revisit: train on their own data (CE, the run's --local_epochs / --local_steps / --batch_size);
  communicate: upload their eval-mode logits on every public row, which the server averages into the next
           round's consensus.
Optimisers (--fedmd_learning_rate, torch's Adam defaults), kept across rounds: with --fedmd_digest=felo each client
keeps one Adam for every loss, as the client objects of Felo's code do; with 'mae' two, as the paper's code (Keras
models compiled apart): the classifier's (its private training: the transfer's second stage, fresh there, and every
revisit) and the digest's (the logits model's, fresh when collaboration starts); the transfer's public stage runs
its own Adam, discarded after it (the code pretrains on the public set before FedMD starts). Every client is scored
with its own model.

The digest loss: 'mae' (the paper's code: mean absolute error between the logits and the consensus, no labels) or
'felo' (Felo's FedMD: CE(z, y) on the public labels + alpha * MSE(log_softmax(z), softmax(consensus)), alpha 0.5,
F.mse_loss a mean over batch and classes).

Choices: the paper's round is communicate -> aggregate -> digest -> revisit; here a round digests the consensus
of the previous round's uploads and ends by communicating, which is the same sequence when every client takes part
(the paper's protocol). Under partial participation Felo's code has the round's participants upload before
digesting; here the consensus comes from the previous round's participants, after their revisit. The consensus is
over the whole public set every round (Felo's code; the paper draws a fresh subset of 5,000 rows each round from
a larger public set: --public_size sets the set's size instead). Public logits are computed in eval mode (Felo's
code leaves its models in training mode there, so BatchNorm would use the batch's statistics); an epoch over the
public rows drops its last partial batch. Not reproduced: Felo's StepLR(2, 0.99) stepped at each evaluation, the
paper's early stopping in transfer learning.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_het.core import (Algorithm, Capabilities, ClientProgram, GroupSpec, Phase, Stage, Traffic, UploadPrivacy,
                             hyperparameter)
from fedjax_het.data.federated import PublicData
from fedjax_het.errors import ConfigError, setting
from fedjax_het.methods.shared.base import KeptOptimizer, kept_optimizer_step, local_head_evaluation, zero_params
from fedjax_het.methods.shared.common import cross_entropy, cross_entropy_loss, train_forward
from fedjax_het.methods.shared.public import PublicRows, PublicSet, mean_of_uploads, public_logits
from fedjax_het.optim import torch_adam

DIGESTS = ('mae', 'felo')


@dataclasses.dataclass(frozen=True)
class FedMDConfig:
  """FedMD's hyperparameters (defaults: Felo's code, the digest loss the paper's)."""
  digest: str = hyperparameter('mae', "FedMD: the digest loss, 'mae' (the paper: |logits - consensus|) or 'felo' "
                                      "(Felo's code: CE on the public labels + alpha MSE(log_softmax, softmax)).",
                               flag='fedmd_digest')
  alpha: float = hyperparameter(0.5, "FedMD: weight of the consensus term of --fedmd_digest=felo.", flag='fedmd_alpha')
  learning_rate: float = hyperparameter(1e-3, "FedMD: the clients' Adam rate (one Adam per client, kept across "
                                              "rounds).", flag='fedmd_learning_rate')
  transfer_public_epochs: int = hyperparameter(5, 'FedMD: transfer-learning epochs on the labelled public set.',
                                               flag='fedmd_transfer_public_epochs')
  transfer_private_epochs: int = hyperparameter(5, 'FedMD: transfer-learning epochs on the client\'s own data.',
                                                flag='fedmd_transfer_private_epochs')
  digest_epochs: int = hyperparameter(1, 'FedMD: epochs over the public set towards the consensus per round.',
                                      flag='fedmd_digest_epochs')
  digest_batch_size: int = hyperparameter(0, 'FedMD: batch size on the public set (0: --batch_size).',
                                          flag='fedmd_digest_batch_size')

  def __post_init__(self):
    if self.digest not in DIGESTS:
      raise ConfigError(f'{setting(self, "digest")} is unknown; choose one of {", ".join(DIGESTS)}.')
    if self.alpha < 0 or self.learning_rate <= 0:
      raise ConfigError(f'{setting(self, "alpha")} must be >= 0 and {setting(self, "learning_rate")} > 0.')
    for name in ('transfer_public_epochs', 'transfer_private_epochs', 'digest_epochs', 'digest_batch_size'):
      if getattr(self, name) < 0:
        raise ConfigError(f'{setting(self, name)} must be >= 0.')


class Consensus(NamedTuple):
  """FedMD's server state, and what it sends: the consensus logits [P, C] on the public rows (None in the transfer
  round, which sends nothing)."""
  consensus: Any


class FedMDBroadcast(NamedTuple):
  """What a client's program reads: the consensus and the public rows it holds (`PublicSet`, not sent)."""
  consensus: Any
  public: PublicSet


class TwoOptimizers(NamedTuple):
  """A client's optimiser states under --fedmd_digest=mae (`ClientState.extra`): classifier, the Adam of its private
  training; digest, the Adam of its digest (in the transfer round, of its public stage)."""
  classifier: Any
  digest: Any


def optimizer_step(optimizer, loss, slot: str = ''):
  """`kept_optimizer_step` on the client's one optimiser (`KeptOptimizer`), or with `slot` on that one of its
  `TwoOptimizers`."""
  inner = kept_optimizer_step(optimizer, loss)
  if not slot:
    return inner

  def step(client, batch, broadcast, key):
    states = client.extra
    out, value = inner(client._replace(extra=KeptOptimizer(getattr(states, slot))), batch, broadcast, key)
    return out._replace(extra=states._replace(**{slot: out.extra.optimizer})), value
  return step


class PublicLogits(NamedTuple):
  """A client's upload: its eval-mode logits [P, C] on every public row."""
  logits: jnp.ndarray


def digest_loss(logits: jnp.ndarray, labels: jnp.ndarray, consensus: jnp.ndarray, kind: str, alpha: float
                ) -> jnp.ndarray:
  """The digest loss on a public batch: 'mae', mean over B x C of |z - consensus|; 'felo', CE(z, y) + alpha *
  mean over B x C of (log_softmax(z) - softmax(consensus))^2."""
  if kind == 'mae':
    return jnp.mean(jnp.abs(logits - consensus))
  gap = jax.nn.log_softmax(logits, -1) - jax.nn.softmax(consensus, -1)
  return cross_entropy(logits, labels) + alpha * jnp.mean(gap ** 2)


def public_ce(group: GroupSpec):
  """The transfer round's loss: CE on a batch of the labelled public rows."""
  def loss(client, batch, broadcast):
    x, y = PublicRows.batch(broadcast.public, batch.index)
    logits, _, client = train_forward(group.model, client, x)
    return cross_entropy(logits, y), client
  return loss


def digest(cfg: FedMDConfig, group: GroupSpec):
  """The digest's loss on a batch of public rows towards their consensus logits (`digest_loss`)."""
  def loss(client, batch, broadcast):
    x, y = PublicRows.batch(broadcast.public, batch.index)
    logits, _, client = train_forward(group.model, client, x)
    return digest_loss(logits, y, broadcast.consensus[batch.index], cfg.digest, cfg.alpha), client
  return loss


def private_ce(group: GroupSpec):
  """CE on a batch of the client's own rows (the transfer's second stage and the revisit)."""
  ce = cross_entropy_loss(group.model)
  return lambda client, batch, broadcast: ce(client, batch, broadcast, None)


def logits_program(group: GroupSpec, stages: tuple[Stage, ...], reset=None) -> ClientProgram:
  """A client program of `stages` that uploads its eval-mode logits on every public row; reset(client) -> client,
  applied after its stages (the transfer round's fresh digest optimiser)."""
  def final(client, client_rows, broadcast, key):
    upload = PublicLogits(public_logits(group.model, client.params, client.model_state, broadcast.public.x))
    return (client if reset is None else reset(client)), upload
  return ClientProgram(lambda client, broadcast, key: client, stages, final, group.training)


def fedmd(cfg: FedMDConfig, num_classes: int, public: PublicData) -> Algorithm:
  """FedMD as an `Algorithm` of two phases: 'transfer' (one round, every client) and 'collaborate'."""
  if int(public.y.max(initial=0)) >= num_classes:
    raise ConfigError(f'FedMD trains on the public labels, and {public.source} has labels up to {int(public.y.max())} '
                      f'where the run has {num_classes} classes. Fix: --public_dataset with the run\'s classes, or '
                      f'--public_size=N rows held out of the run\'s own data.')
  rows = PublicRows(public)
  adam = torch_adam(cfg.learning_rate)
  public_schedule = lambda group: rows.training(cfg.digest_batch_size or group.training.batch_size,
                                                group.training.order)

  two = cfg.digest == 'mae'  # the paper's code: the classifier's and the digest's Adam apart
  public_slot, private_slot, digest_slot = ('digest', 'classifier', 'digest') if two else ('', '', '')
  # after the transfer round the digest's Adam starts fresh (the public stage's was the code's pretraining's)
  reset = (lambda client: client._replace(extra=client.extra._replace(digest=adam.init(client.params)))) if two \
      else None

  def transfer(group):
    whole_epochs = dataclasses.replace(group.training, max_steps=None)
    return logits_program(group, (Stage(optimizer_step(adam, public_ce(group), public_slot),
                                        cfg.transfer_public_epochs, training=public_schedule(group)),
                                  Stage(optimizer_step(adam, private_ce(group), private_slot),
                                        cfg.transfer_private_epochs, training=whole_epochs)), reset)

  def collaborate(group):
    return logits_program(group, (Stage(optimizer_step(adam, digest(cfg, group), digest_slot), cfg.digest_epochs,
                                        training=public_schedule(group)),
                                  Stage(optimizer_step(adam, private_ce(group), private_slot), group.training.epochs)))

  def init_client(group, key):
    state = adam.init(zero_params(group))
    return TwoOptimizers(state, state) if two else KeptOptimizer(state)

  def server_update(server, uploads, key, public):
    """The consensus: the unweighted mean of the participants' public logits."""
    return Consensus(mean_of_uploads(uploads, 'logits')), {}

  with_public = lambda broadcast, public: FedMDBroadcast(broadcast.consensus, public)
  phases = (Phase('transfer', transfer, server_update, broadcast=lambda server, group: Consensus(None), rounds=1,
                  join_ratio=1.0, traffic=Traffic(broadcast=lambda b: {}), with_constants=with_public),
            Phase('collaborate', collaborate, server_update, with_constants=with_public))
  return Algorithm('fedmd', lambda key, spec, initial: Consensus(jnp.zeros((rows.size, num_classes))), phases,
                   local_head_evaluation, init_client=init_client,
                   capabilities=Capabilities(partial_batches=True, shares_representations=False),
                   constants=rows.constants,
                   upload_privacy=UploadPrivacy(aggregate='sum', hides_participants=True))
