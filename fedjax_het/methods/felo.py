"""Felo and FedHe ("Exploiting Features and Logits in Heterogeneous Federated Learning", Sec. 3, Eq. 1, Alg. 1):
clients exchange per-class mid-level features and logits, and the server keeps them in per-class stores across rounds.

Client k in a round: its model set to its group's model (model-wise FedAvg, paper Sec. 3.1.2), then local steps on
  L = CE(p(x), y) + alpha [MSE(s(x), s^s_y) + KL(softmax(p^s_y) || softmax(p(x)))]        (Eq. 1)
with s(x) the mid-level feature (the library's representation after RM, width d in every architecture; the head is
one Linear, the code's `one_classifer_flag`) and p(x) the logits. The MSE is F.mse_loss, a mean over B x d; the KL
is the code's `F.kl_div(log_softmax(p), softmax(p^s), reduction='mean')`, a sum over B x C divided by B C
(`common.elementwise_kl`). Rows whose class has no server vector yet add 0 to both terms but still count in the
means (the code would raise). The first `--felo_warmup` share of the rounds is CE only (Alg. 1 line 9).
The optimizer is Adam (--felo_learning_rate, torch's defaults) whose state each client keeps across rounds
(`base.KeptOptimizer`), with torch's MultiStepLR x0.1 at 40 % and 70 % of --rounds, stepped every
round for every client (the rate depends on the round only). During the same steps the client sums, per class,
its training-mode logits and features before each update (`class_sums`) and uploads: the per-class mean logit
with its count, and the per-class feature sums with their counts (d + 1 scalars per class).

Server: per class a FIFO of logit uploads (--felo_logit_store, 50,000 in the code: never reached) whose
unweighted mean is p^s_y (every client-round counts once), and a FIFO of features (--felo_feature_store, 5,000
per class) whose mean is s^s_y. Felo's store holds (sum, count) pairs; its mean is over the newest 5,000 features
the pairs stand for, the oldest pair counted in part (`window_mean`: exact for the code's per-sample FIFO up to
the mix of features inside that one pair). Model-wise FedAvg within each architecture group (sample-weighted,
`participant_average`; BatchNorm statistics stay with the clients, as `fedavg`).

FedHe (the paper's logits-only baseline) is Felo without the feature term (MSE), nothing else changed.

Choices where paper and code differ: KL as the paper (the code's default without
--KLD_flag is a logit MSE); alpha 0.5 (code; the paper gives none); weight averaging as the paper (the code has
none: --nofelo_average_models reproduces that); per-class feature means uploaded as the paper (the code uploads
every training feature; Velo does). One library round is one of the code's iterations; the code's local training,
`clients_training_epoch = 10` steps of batch 50, is --local_steps=10 --batch_size=50 (the first 10 steps of a
shuffled epoch; the paper flag files set it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from fedjax_het.core import (Algorithm, Batch, ClientProgram, ClientState, GroupSpec, Phase, RoundUploads, Traffic,
                             Uploads, hyperparameter, leaf_scalars, single_stage)
from fedjax_het.errors import ConfigError, setting
from fedjax_het.methods.fedavg import receive_group_model
from fedjax_het.methods.shared.base import KeptOptimizer, head_evaluation, own_head, zero_params
from fedjax_het.methods.shared.common import (class_means_from_sums, class_sums, cross_entropy, elementwise_kl,
                                              prototype_regularizer)
from fedjax_het.models.forward import forward
from fedjax_het.optim import multistep_factor, step_at_rate, torch_adam
from fedjax_het.uploads import holders, masked_mean

MILESTONES = (0.4, 0.7)  # MultiStepLR milestones as shares of the rounds (the code's int(0.4 R), int(0.7 R))


@dataclasses.dataclass(frozen=True)
class FeloConfig:
  """Felo's hyperparameters (the code's defaults)."""
  alpha: float = hyperparameter(0.5, 'Felo/Velo/FedHe: weight alpha of the feature MSE + logit KL terms (Eq. 1).',
                                flag='felo_alpha')
  learning_rate: float = hyperparameter(1e-3, 'Felo/Velo/FedHe: the clients\' Adam learning rate (state kept across '
                                              'rounds; x0.1 at 40 % and 70 % of --rounds).',
                                        flag='felo_learning_rate')
  warmup: float = hyperparameter(0.05, 'Felo/Velo/FedHe: share of the rounds trained on CE only (Alg. 1 line 9).',
                                 flag='felo_warmup')
  average_models: bool = hyperparameter(True, 'Felo/Velo/FedHe: model-wise FedAvg within each architecture group '
                                              '(paper; false: the code\'s none).', flag='felo_average_models')
  logit_store: int = hyperparameter(50000, 'Felo/Velo/FedHe: per-class FIFO length of logit uploads.',
                                    flag='felo_logit_store')
  feature_store: int = hyperparameter(5000, 'Felo/Velo: per-class FIFO length of stored features.',
                                      flag='felo_feature_store')

  def __post_init__(self):
    if not (math.isfinite(self.alpha) and self.alpha >= 0):
      raise ConfigError(f'{setting(self, "alpha")} must be a finite number >= 0.')
    if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
      raise ConfigError(f'{setting(self, "learning_rate")} must be > 0.')
    if not 0 <= self.warmup < 1:
      raise ConfigError(f'{setting(self, "warmup")} must be in [0, 1).')
    if self.logit_store < 1 or self.feature_store < 1:
      raise ConfigError(f'{setting(self, "logit_store")} and {setting(self, "feature_store")} must '
                        f'be >= 1.')


def warmup_rounds(warmup: float, rounds: int) -> int:
  """Rounds trained on CE only: the first ceil(warmup * rounds) (the code's `iteration < 0.05 * total`)."""
  return math.ceil(warmup * rounds - 1e-9)


def multistep_scale(round_index: jnp.ndarray, rounds: int) -> jnp.ndarray:
  """torch MultiStepLR(milestones=[int(0.4 R), int(0.7 R)], gamma=0.1) after `round_index` scheduler steps: the
  factor on the base rate in round round_index (0-based)."""
  return multistep_factor(round_index, [int(m * rounds) for m in MILESTONES], 0.1)


# ------------------------------------------------------------------ the server's per-class FIFO stores
class FIFOStore(NamedTuple):
  """A per-class FIFO of `capacity` rows of `width` per class: values [C, capacity, width] and pushed [C], how
  many rows each class has received (the newest at slot (pushed - 1) mod capacity)."""
  values: jnp.ndarray
  pushed: jnp.ndarray


def empty_store(num_classes: int, capacity: int, width: int) -> FIFOStore:
  """An empty `FIFOStore`."""
  return FIFOStore(jnp.zeros((num_classes, capacity, width)), jnp.zeros(num_classes, jnp.int32))


def push(store: FIFOStore, rows: jnp.ndarray, labels: jnp.ndarray, valid: jnp.ndarray) -> FIFOStore:
  """The store with the valid rows [N, width] appended to their classes' FIFOs in row order, each evicting its
  class's oldest row once the FIFO is full (of more rows of a class than fit, only the newest are kept)."""
  num_classes, capacity, _ = store.values.shape
  onehot = jax.nn.one_hot(labels, num_classes, dtype=jnp.int32) * valid[:, None].astype(jnp.int32)
  rank = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=1) - 1      # position among this push's rows of y
  added = onehot.sum(0)
  kept = valid & (rank >= added[labels] - capacity)                   # duplicates would make the scatter ambiguous
  slot = (store.pushed[labels] + rank) % capacity
  values = store.values.at[jnp.where(kept, labels, num_classes), slot].set(rows, mode='drop')
  return FIFOStore(values, store.pushed + added)


def newest_first(store: FIFOStore) -> jnp.ndarray:
  """[C, capacity] age rank of each slot (0 = newest), capacity for empty slots."""
  capacity = store.values.shape[1]
  age = (store.pushed[:, None] - 1 - jnp.arange(capacity)[None, :]) % capacity
  return jnp.where(age < jnp.minimum(store.pushed, capacity)[:, None], age, capacity)


def store_mean(store: FIFOStore) -> tuple[jnp.ndarray, jnp.ndarray]:
  """(the unweighted mean of each class's stored rows [C, width] (0 when empty), present [C])."""
  filled = (newest_first(store) < store.values.shape[1]).astype(store.values.dtype)
  count = filled.sum(1)
  return jnp.einsum('cs,csw->cw', filled, store.values) / jnp.maximum(count, 1.0)[:, None], count > 0


def window_mean(store: FIFOStore, window: int) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Felo's feature means from a store of (sum [d], count) pairs (width d + 1): per class the mean of the newest
  `window` features the pairs stand for, newest pairs first, the pair that crosses the window counted by the
  share of its features inside it. Returns (means [C, d], present [C])."""
  capacity = store.values.shape[1]
  age = newest_first(store)
  sums, counts = store.values[..., :-1], store.values[..., -1] * (age < capacity)
  by_age = jnp.take_along_axis(counts, jnp.argsort(age, axis=1), axis=1)
  before_by_age = jnp.cumsum(by_age, axis=1) - by_age                   # features newer than each pair
  before = jnp.take_along_axis(before_by_age, jnp.minimum(age, capacity - 1), axis=1)
  share = jnp.clip((window - before) / jnp.maximum(counts, 1.0), 0.0, 1.0) * (counts > 0)
  total = jnp.sum(share * counts, axis=1)
  return jnp.einsum('cs,csd->cd', share, sums) / jnp.maximum(total, 1e-12)[:, None], total > 0


# ------------------------------------------------------------------ the client
def felo_terms(logits, features, labels, broadcast, alpha, with_features: bool) -> jnp.ndarray:
  """The three terms of Eq. 1, [CE, alpha * distill * MSE(s, s^s_y), alpha * distill * KL(softmax(p^s_y) ||
  softmax(p))], distill 0 in warm-up rounds; FedHe has no MSE term (0)."""
  kl = elementwise_kl(broadcast.logits[labels], logits, broadcast.logit_present[labels])
  mse = (prototype_regularizer(features, labels, broadcast.features, broadcast.feature_present)
         if with_features else jnp.zeros(()))
  weight = alpha * broadcast.distill
  return jnp.stack([cross_entropy(logits, labels), weight * mse, weight * kl])


def felo_loss(logits, features, labels, broadcast, alpha, with_features: bool) -> jnp.ndarray:
  """Eq. 1: CE + alpha * distill * (MSE(s, s^s_y) + KL(softmax(p^s_y) || softmax(p))) (`felo_terms`)."""
  return felo_terms(logits, features, labels, broadcast, alpha, with_features).sum()


def adam_client_program(group: GroupSpec, cfg: FeloConfig, with_features: bool, statistics, gather, upload
                        ) -> ClientProgram:
  """The client program of Felo, Velo and FedHe: receive the group model (when averaging), Adam steps on
  `felo_loss` with the client's own optimizer state, scaled to the round's rate; `gather(stats, logits, features,
  labels)` adds a step's training-mode outputs to the statistics (`statistics()` the empty ones); upload(client,
  stats) -> the `FeloUpload`, whose loss_terms the program sets: the mean of each of Eq. 1's terms over the
  client's steps (`felo_terms`; a diagnostic the server logs, not part of the method's traffic)."""
  adam = torch_adam(cfg.learning_rate)

  def init(client, broadcast, key):
    if cfg.average_models:
      client = receive_group_model(client, broadcast)
    return client, statistics(), jnp.zeros(4)  # summed [CE, alpha MSE, alpha KL, steps]

  def step(carry, batch: Batch, broadcast, key):
    client, stats, terms = carry

    def objective(params):
      logits, features, model_state = forward(group.model, params, client.model_state, batch.x, True)
      parts = felo_terms(logits, features, batch.y, broadcast, cfg.alpha, with_features)
      return parts.sum(), (model_state, logits, features, parts)
    (value, (model_state, logits, features, parts)), grads = jax.value_and_grad(objective, has_aux=True)(
        client.params)
    params, opt_state = step_at_rate(adam, client.params, grads, client.extra.optimizer,
                                     cfg.learning_rate * broadcast.lr_scale)  # the round's MultiStepLR
    client = client._replace(params=params, model_state=model_state, extra=KeptOptimizer(opt_state))
    terms = terms + jnp.concatenate([jax.lax.stop_gradient(parts), jnp.ones(1)])
    return (client, gather(stats, logits, features, batch.y), terms), value

  def final(carry, rows, broadcast, key):
    client, stats, terms = carry
    return client, upload(client, stats)._replace(loss_terms=terms[:3] / jnp.maximum(terms[3], 1.0))

  return ClientProgram(init, single_stage(step, group.training), final, group.training)


class ClassStatistics(NamedTuple):
  """What a client gathers over its training steps: per-class (sums, counts) of its logits and of its features,
  and what its method's feature channel gathers besides (Velo's rows; None for the others)."""
  logits: tuple
  features: tuple
  channel: Any = None


def per_class_statistics(num_classes: int, feature_dim: int, channel=None):
  """(empty, gather) of per-class sums and counts of logits and features over the training steps, and of the
  feature channel's own statistics (`channel`: its (empty, gather), or None)."""
  def empty():
    return ClassStatistics((jnp.zeros((num_classes, num_classes)), jnp.zeros(num_classes)),
                           (jnp.zeros((num_classes, feature_dim)), jnp.zeros(num_classes)),
                           channel[0]() if channel is not None else None)

  def gather(stats, logits, features, labels):
    sums = jax.tree.map(jnp.add, (stats.logits, stats.features),
                        (class_sums(logits, labels, num_classes), class_sums(features, labels, num_classes)))
    more = channel[1](stats.channel, logits, features, labels) if channel is not None else None
    return ClassStatistics(*sums, more)
  return empty, gather


class FeloUpload(NamedTuple):
  """A Felo-family client's upload: logits [C, C], its per-class mean logits, and logit_counts [C] (0: a class it
  does not hold); features, its feature channel's part (Felo's `FeaturePairs`, Velo's `FeatureRows`; None for
  FedHe); model, its trained params when averaging (else None); loss_terms [3], the mean of each term of Eq. 1
  over its steps (a diagnostic)."""
  logits: jnp.ndarray
  logit_counts: jnp.ndarray
  features: Any = None
  model: Any = None
  loss_terms: Any = None


def logit_upload(stats: ClassStatistics) -> FeloUpload:
  """The per-class mean logits of the training steps with their counts (counts 0: class not held)."""
  return FeloUpload(*class_means_from_sums(stats.logits))


def client_rows(values: jnp.ndarray, holds: jnp.ndarray):
  """Per-client per-class uploads [K, C, w] as store rows: (rows [K C, w], labels [K C], valid [K C]) for the
  classes a participant holds (holds [K, C], `Uploads.holds`)."""
  k, c = holds.shape
  return values.reshape(k * c, -1), jnp.tile(jnp.arange(c), k), holds.reshape(k * c)


def class_uploads(uploads: RoundUploads) -> Uploads:
  """All groups' uploads but their models (which differ in shape between architectures), as one `Uploads`."""
  return uploads.every(lambda values: values._replace(model=None))


# ------------------------------------------------------------------ the algorithm
class FeloRun(NamedTuple):
  """A Felo-family method's run: its name, config, classes, rounds, clients, and how it shares class features
  (`FeatureChannel`; None: logits only, FedHe)."""
  name: str
  cfg: FeloConfig
  num_classes: int
  rounds: int
  num_clients: int
  features: Optional['FeatureChannel']

  def capacity(self, cap: int) -> int:
    """A FIFO of uploads never holds more than the run's client-rounds: no longer than that."""
    return max(1, min(cap, self.rounds * self.num_clients))


class FeatureChannel(NamedTuple):
  """How a Felo-family method shares class features (Felo: per-class (sum, count) pairs averaged over a window of
  uploads; Velo: feature rows and a server CVAE). Each function takes the `FeloRun` first.

  init_server(run, spec, key) -> the channel's server state (`FeloServer.channel`); statistics(run, group) ->
  (empty, gather) of what the client gathers besides the per-class sums (`ClassStatistics.channel`), or None;
  upload(stats) -> the feature part of the upload (`FeloUpload.features`); server(run, server, uploads, key) ->
  (server with its channel state, features and feature_present set, metrics); scalars(features) -> the scalars
  of the upload's feature part."""
  init_server: Callable[..., Any]
  statistics: Optional[Callable[..., tuple[Callable, Callable]]]
  upload: Callable[[ClassStatistics], Any]
  server: Callable[..., tuple['FeloServer', dict]]
  scalars: Callable[[Any], jnp.ndarray]


class FeloServer(NamedTuple):
  """A Felo-family server: round, the rounds done; models, each group's model (averaged when asked); logit_store,
  the per-class FIFO of uploaded class logits; logits [C, C] and logit_present [C], the class logits it sends;
  features [C, d] and feature_present [C], the class features it sends; channel, the feature channel's own state
  (Felo: a FIFO of (sum, count) pairs; Velo: `VeloChannel`; None for FedHe)."""
  round: jnp.ndarray
  models: tuple
  logit_store: FIFOStore
  logits: jnp.ndarray
  logit_present: jnp.ndarray
  features: jnp.ndarray
  feature_present: jnp.ndarray
  channel: Any = None


class FeloBroadcast(NamedTuple):
  """What a group's clients receive: the class logits and features that exist, distill (1.0 once warm-up is
  over), lr_scale (the round's MultiStepLR factor) and model, the group's model when averaging (else None)."""
  logits: jnp.ndarray
  logit_present: jnp.ndarray
  features: jnp.ndarray
  feature_present: jnp.ndarray
  distill: jnp.ndarray
  lr_scale: jnp.ndarray
  model: Any = None


class FeaturePairs(NamedTuple):
  """Felo's feature upload: per-class feature sums [C, d] and counts [C] of the client's training steps."""
  sums: jnp.ndarray
  counts: jnp.ndarray


def class_pair_store(run: FeloRun, spec, key: jax.Array) -> FIFOStore:
  """Felo's channel state: a FIFO per class of uploaded (feature sum, count) pairs."""
  return empty_store(run.num_classes, run.capacity(run.cfg.feature_store), spec.feature_dim + 1)


def class_pair_upload(stats: ClassStatistics) -> FeaturePairs:
  """Felo's feature upload: per-class feature sums and counts."""
  return FeaturePairs(*stats.features)


def class_pair_server(run: FeloRun, server: FeloServer, uploads, key: jax.Array) -> tuple[FeloServer, dict]:
  """Felo's class features: the uploaded pairs pushed to their class's FIFO, the mean over its window."""
  u = class_uploads(uploads)
  pairs = jnp.concatenate([u.values.features.sums, u.values.features.counts[..., None]], axis=-1)
  store = push(server.channel, *client_rows(pairs, holders(u.values.features.counts, u.mask)))
  features, present = window_mean(store, run.cfg.feature_store)
  return server._replace(channel=store, features=features, feature_present=present), {}


FELO_FEATURES = FeatureChannel(
    class_pair_store, None, class_pair_upload, class_pair_server,
    lambda pairs: jnp.sum(pairs.counts > 0) * (pairs.sums.shape[-1] + 1))


def init_client_extra(run: FeloRun, group: GroupSpec, key: jax.Array) -> KeptOptimizer:
  """The client's own Adam state (kept across rounds, as the code's per-client optimizer)."""
  return KeptOptimizer(torch_adam(run.cfg.learning_rate).init(zero_params(group)))


def init_server(run: FeloRun, key: jax.Array, spec, initial) -> FeloServer:
  """Round 0, each group's first model, empty logit store, no class logits or features yet."""
  num_classes = run.num_classes
  channel = run.features.init_server(run, spec, key) if run.features is not None else None
  return FeloServer(jnp.zeros((), jnp.int32), tuple(s.params for s in initial),
                    empty_store(num_classes, run.capacity(run.cfg.logit_store), num_classes),
                    jnp.zeros((num_classes, num_classes)), jnp.zeros(num_classes, bool),
                    jnp.zeros((num_classes, spec.feature_dim)), jnp.zeros(num_classes, bool), channel)


def broadcast(run: FeloRun, server: FeloServer, group) -> FeloBroadcast:
  """Class logits and features, whether distillation is on (after warm-up), the round's MultiStepLR scale, and
  the group's model when averaging."""
  return FeloBroadcast(server.logits, server.logit_present, server.features, server.feature_present,
                       (server.round >= warmup_rounds(run.cfg.warmup, run.rounds)).astype(jnp.float32),
                       multistep_scale(server.round, run.rounds),
                       server.models[group.index] if run.cfg.average_models else None)


def client_program(run: FeloRun, group: GroupSpec) -> ClientProgram:
  """Adam on Eq. 1 (`adam_client_program`); uploads per-class logits, the feature channel's part, the model when
  averaging."""
  channel = run.features
  more = channel.statistics(run, group) if channel is not None and channel.statistics is not None else None
  empty, gather = per_class_statistics(run.num_classes, group.feature_dim, more)

  def upload(client: ClientState, stats: ClassStatistics) -> FeloUpload:
    return logit_upload(stats)._replace(features=channel.upload(stats) if channel is not None else None,
                                        model=client.params if run.cfg.average_models else None)
  return adam_client_program(group, run.cfg, channel is not None, empty, gather, upload)


def server_update(run: FeloRun, server: FeloServer, uploads, key: jax.Array) -> tuple[FeloServer, dict]:
  """Pushes the uploaded class logits to their FIFOs (class logits: the stores' means), updates the class
  features through the channel, averages each group's models when asked, and counts the round."""
  u = class_uploads(uploads)
  logit_store = push(server.logit_store, *client_rows(u.values.logits, u.holds('logit_counts')))
  logits, logit_present = store_mean(logit_store)
  server = server._replace(logit_store=logit_store, logits=logits, logit_present=logit_present)
  terms = masked_mean(u.values.loss_terms, u.mask)  # the participants' mean of each term of Eq. 1 over their steps
  metrics = {'logit_classes': logit_present.sum(), 'client_ce': terms[0], 'client_alpha_mse': terms[1],
             'client_alpha_kl': terms[2]}
  if run.features is not None:
    server, more = run.features.server(run, server, uploads, key)
    metrics.update(more)
  if run.cfg.average_models:
    server = server._replace(models=uploads.group_mean('model', by='rows', previous=server.models))
  return server._replace(round=server.round + 1), metrics


def evaluation(run: FeloRun, group: GroupSpec):
  """Every client scored with its own model (its group's model when averaging)."""
  receive = receive_group_model if run.cfg.average_models else None
  return head_evaluation(group.model, {'local_head': own_head}, receive=receive)


def upload_scalars(run: FeloRun, upload: FeloUpload) -> dict:
  """C logits per class held (the count is metadata), the model when averaging, the features."""
  out = {'logits': jnp.sum(upload.logit_counts > 0) * run.num_classes}
  if run.cfg.average_models:
    out['model'] = sum(leaf_scalars(upload.model).values())
  if run.features is not None:
    out['features'] = run.features.scalars(upload.features)
  return out


def broadcast_scalars(run: FeloRun, b: FeloBroadcast) -> dict:
  """The server's class logits and (Felo, Velo) class features that exist, and the group model."""
  out = {'logits': jnp.sum(b.logit_present) * run.num_classes}
  if run.features is not None:
    out['features'] = jnp.sum(b.feature_present) * b.features.shape[-1]
  if run.cfg.average_models:
    out['model'] = sum(leaf_scalars(b.model).values())
  return out


def felo_family(run: FeloRun) -> Algorithm:
  """Felo, FedHe and Velo as one `Algorithm` of one phase over the run's rounds."""
  bind = lambda fn: functools.partial(fn, run)
  traffic = Traffic(bind(upload_scalars), bind(broadcast_scalars))
  return Algorithm(run.name, bind(init_server), (Phase(run.name, bind(client_program), bind(server_update),
                                                       bind(broadcast), traffic=traffic),),
                   bind(evaluation), init_client=bind(init_client_extra))


def felo(cfg: FeloConfig, num_classes: int, rounds: int, num_clients: int) -> Algorithm:
  """Felo as an `Algorithm`: per-class logits and feature means, model-wise FedAvg within groups."""
  return felo_family(FeloRun('felo', cfg, num_classes, rounds, num_clients, FELO_FEATURES))


@dataclasses.dataclass(frozen=True)
class FedHeConfig(FeloConfig):
  """FedHe's hyperparameters: Felo's, but no weights are averaged by default. The Felo paper's FedHe shares
  logits only, and so does the code's FedHe path (`Server.py`, which averages weights only under its asynchronous
  homogeneous mode); --felo_average_models adds FedAvg within groups."""
  average_models: bool = hyperparameter(False, 'Felo/Velo/FedHe: model-wise FedAvg within each architecture group '
                                               '(Felo, Velo: the paper; FedHe: off, logits only).',
                                        flag='felo_average_models')


def fedhe(cfg: FeloConfig, num_classes: int, rounds: int, num_clients: int) -> Algorithm:
  """FedHe as the Felo paper's baseline: per-class logits only, no feature term and (by default, `FedHeConfig`)
  no weight averaging."""
  return felo_family(FeloRun('fedhe', cfg, num_classes, rounds, num_clients, None))
