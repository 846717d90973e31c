"""FedType (Wang, Zhao, Lyu, You, Huai and Ma, ICML 2024, "Bridging model heterogeneity in federated learning via
uncertainty-based asymmetrical reciprocity learning"), a baseline of FedVTC's Tables 1-2
("Bridging Generalization Gap of Heterogeneous Federated Clients Using Generative Models", Sec. 4),
after its authors' code (JackqqWang/FedType, `update_new.py`, `conformal.py`, `my_utils.py`).

Every client holds its own private model w_k and a copy of a small shared proxy model p (--fedtype_proxy, else
`--global_model`; the paper's ResNet-18, its code's with the 3x3 stem: resnet18_cifar). A round, after receiving p:
  0. Calibration (split conformal prediction, RAPS of Angelopoulos et al. 2021, as the code): on the client's
     training rows, each model's randomised RAPS score of the true label,
       E = U pi_(r) + sum_{j<r} pi_(j) + sum_{j<=r} pen_j,   pen_j = lam [j >= k_reg],   U ~ U(0, 1),
     with pi_(0) >= pi_(1) >= ... the sorted softmax and r the label's rank, and the threshold
     Qhat = the (1 - alpha) quantile of the scores (numpy's 'higher'; alpha = --fedtype_alpha, k_reg = 5,
     lam = 0.5 for p and 1.0 for w_k). A row's prediction set S is its top classes up to the last whose cumulative
     pi + pen stays <= Qhat, plus one, the last dropped at random as RAPS does, never empty.
  1. Per local epoch (--local_epochs): a pass of w_k with p frozen (eval mode),
       L_w = CE(w_k(x), y) + c * R(w_k(x); S_p),
     the consensus c = the batch mean of |S_w n S_p| / |S_w u S_p| (|S_w| <= |S_p|) or |S_w n S_p| / |S_p|
     (otherwise), a constant; R = the mean over rows of (1 / (|S_p| |not S_p|)) sum_{a in S_p, b not in S_p}
     relu(z_b - z_a) on w_k's logits z (0 where S_p holds every class): the private model learns to rank the
     proxy's confident classes first, weighted by how far the two models' uncertainty sets agree;
  2. then a pass of p with w_k frozen (eval mode),
       L_p = CE(p(x), y) + KL(softmax(w_k(x) / T) || softmax(p(x) / T)),
     the KL as torch's KLDivLoss() computes it (mean over batch and classes; T = --fedtype_temperature).
  Both models by Adam (--fedtype_learning_rate, weight decay --fedtype_weight_decay as an L2 term, PyTorch's
  Adam), fresh every round. The client uploads p; the server averages the participants' copies unweighted.
Scored: 'private' (w_k, the reported accuracy) and 'proxy' (p as the client holds it).

The paper's method section could not be read here; where the code and the paper's summaries differ this module
states its choice. In the released code the backward term R is computed on the frozen proxy's logits (its
private-model argument only gives a shape), so no gradient reaches w_k, which trains on CE alone, and its hinge
ranks the set below the rest; the "dynamic" RAPS penalty it derives from the private model's training accuracy
is passed only to a conformal model that is then discarded. Here R acts on w_k's logits with the sign that
ranks S_p first (--fedtype_backward=ranking, the default: the reciprocity the paper describes, backward knowledge
distillation through uncertainty sets with consensus weighting), and the penalty stays lam.
--fedtype_backward=none trains w_k on CE alone, the released code's effect. Also: R is averaged over rows (the
code divides by the batch size twice); the code fits a temperature to the calibration logits (Platt scaling)
before RAPS, not done here (T = 1: the sets keep their coverage, their sizes differ); the calibration uses eval
mode; the proxy's BatchNorm statistics stay each client's own (the code averages them too; the library's shared
global models send parameters only); the code's proxy is a CIFAR-style ResNet-18 (3x3 stem, no max pool), the
library's has torchvision's stem.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_het.core import Capabilities, ClientProgram, GroupSpec, Stage, hyperparameter
from fedjax_het.errors import ConfigError, setting
from fedjax_het.methods.shared.base import Algorithm, ClientState, Evaluation, one_phase
from fedjax_het.methods.shared.common import batch_mean, cross_entropy, distillation_loss
from fedjax_het.methods.shared.global_model import (GLOBAL_MODEL_PRIVACY, average_global_models, check_global_model,
                                                    global_model_step, init_global_model, initial_global_model,
                                                    receive_global_model, upload_carried_global_model)
from fedjax_het.models.forward import forward
from fedjax_het.models.registry import model_names

BACKWARDS = ('ranking', 'none')
RAPS_KREG = 5  # the code's small_kreg = large_kreg
PROXY_LAMBDA, PRIVATE_LAMBDA = 0.5, 1.0  # the code's small_lamda, large_lamda


@dataclasses.dataclass(frozen=True)
class FedTypeConfig:
  """FedType's proxy, conformal prediction and optimiser (its code's defaults)."""

  @property
  def proxy_model(self) -> str:
    """The proxy's architecture: --fedtype_proxy, else --global_model."""
    return self.proxy or self.global_model
  global_model: str = hyperparameter('resnet18', 'Architecture of the small global model every client trains '
                                     'beside its own.')
  proxy: str = hyperparameter('', "FedType: the proxy's architecture; empty: --global_model. Its code's proxy is "
                                  "resnet18_cifar (a ResNet-18 with the 3x3 stem), which FedVTC's flag files set.",
                              flag='fedtype_proxy')
  alpha: float = hyperparameter(0.1, 'FedType: miscoverage alpha of the conformal prediction sets (RAPS).',
                                flag='fedtype_alpha')
  temperature: float = hyperparameter(1.0, 'FedType: distillation temperature T of the proxy\'s KL term.',
                                      flag='fedtype_temperature')
  backward: str = hyperparameter('ranking', "FedType: the private model's term from the proxy: 'ranking' (the "
                                 "consensus-weighted ranking of the proxy's prediction set) or 'none' (CE alone, "
                                 "the released code's effect).", flag='fedtype_backward')
  learning_rate: float = hyperparameter(1e-3, 'FedType: Adam rate of the private and the proxy model '
                                        '(--local_learning_rate is not read).', flag='fedtype_learning_rate')
  weight_decay: float = hyperparameter(1e-4, 'FedType: Adam\'s L2 weight decay of both models.',
                                       flag='fedtype_weight_decay')

  def __post_init__(self):
    if not 0 < self.alpha < 1:
      raise ConfigError(f'{setting(self, "alpha")} must be in (0, 1).')
    if self.backward not in BACKWARDS:
      raise ConfigError(f'{setting(self, "backward")}: choose one of {", ".join(BACKWARDS)}.')
    if self.temperature <= 0 or self.learning_rate <= 0 or self.weight_decay < 0:
      raise ConfigError(f'{setting(self, "temperature")} and {setting(self, "learning_rate")} must be > 0, '
                        f'{setting(self, "weight_decay")} >= 0.')


def _sorted_probabilities(logits: jnp.ndarray, kreg: int, lam: float):
  """(order [B, C] of classes by descending softmax, sorted probabilities, their cumulative sums, the cumulative
  RAPS penalties [C])."""
  probs = jax.nn.softmax(logits, -1)
  order = jnp.argsort(-probs, axis=-1, stable=True)
  ranked = jnp.take_along_axis(probs, order, -1)
  penalties = lam * (jnp.arange(logits.shape[-1]) >= kreg).astype(probs.dtype)
  return order, ranked, jnp.cumsum(ranked, -1), jnp.cumsum(penalties)


def raps_scores(logits: jnp.ndarray, labels: jnp.ndarray, u: jnp.ndarray, kreg: int, lam: float) -> jnp.ndarray:
  """Randomised RAPS conformity scores [B] of the true labels: U pi_(r) + sum_{j<r} pi_(j) + sum_{j<=r} pen_j."""
  order, ranked, cumulative, pen_cumulative = _sorted_probabilities(logits, kreg, lam)
  rank = jnp.argmax(order == labels[:, None], axis=-1)
  at = lambda a: jnp.take_along_axis(a, rank[:, None], -1)[:, 0]
  p = at(ranked)
  return u * p + at(cumulative) - p + pen_cumulative[rank]


def conformal_threshold(scores: jnp.ndarray, real: jnp.ndarray, alpha: float) -> jnp.ndarray:
  """Qhat: numpy's quantile(scores[real], 1 - alpha, method='higher'), the code's (no (n + 1) correction)."""
  n = jnp.sum(real)
  ranked = jnp.sort(jnp.where(real, scores, jnp.inf))
  index = jnp.ceil((n - 1) * (1.0 - alpha)).astype(jnp.int32)
  return ranked[jnp.clip(index, 0, scores.shape[0] - 1)]


def raps_sets(logits: jnp.ndarray, threshold: jnp.ndarray, u: jnp.ndarray, kreg: int, lam: float) -> jnp.ndarray:
  """RAPS prediction sets [B, C] (bool) at threshold Qhat: the top classes up to the last whose cumulative
  probability plus penalty stays <= Qhat, plus one; that last one dropped when U >= V (randomised RAPS); never
  empty."""
  order, ranked, cumulative, pen_cumulative = _sorted_probabilities(logits, kreg, lam)
  num_classes = logits.shape[-1]
  base = jnp.minimum(jnp.sum(cumulative + pen_cumulative <= threshold, -1) + 1, num_classes)
  last = base - 1
  at = lambda a: jnp.take_along_axis(a, last[:, None], -1)[:, 0]
  p_last = at(ranked)
  v = (threshold - (at(cumulative) - p_last) - pen_cumulative[last]) / p_last
  size = jnp.maximum(base - (u >= v).astype(base.dtype), 1)
  in_sorted = jnp.arange(num_classes) < size[:, None]
  return jnp.zeros_like(in_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(in_sorted)


def consensus(proxy_sets: jnp.ndarray, private_sets: jnp.ndarray, mask=None) -> jnp.ndarray:
  """c: the batch mean of |S_w n S_p| / |S_w u S_p| where |S_w| <= |S_p|, else |S_w n S_p| / |S_p| (the code's
  cal_consensus)."""
  inter = jnp.sum(proxy_sets & private_sets, -1).astype(jnp.float32)
  union = jnp.sum(proxy_sets | private_sets, -1).astype(jnp.float32)
  n_p, n_w = jnp.sum(proxy_sets, -1), jnp.sum(private_sets, -1)
  per_row = jnp.where(n_w <= n_p, inter / jnp.maximum(union, 1.0), inter / jnp.maximum(n_p, 1))
  return per_row.mean() if mask is None else batch_mean(per_row, mask)


def ranking_loss(logits: jnp.ndarray, sets: jnp.ndarray, mask=None) -> jnp.ndarray:
  """R: the mean over rows of (1 / (|S| |not S|)) sum_{a in S, b not in S} relu(z_b - z_a); 0 for a row whose set
  holds every class."""
  pairs = (sets[:, :, None] & ~sets[:, None, :]).astype(logits.dtype)  # [B, a, b]
  hinge = jax.nn.relu(logits[:, None, :] - logits[:, :, None])          # z_b - z_a
  count = jnp.sum(pairs, (1, 2))
  per_row = jnp.sum(pairs * hinge, (1, 2)) / jnp.maximum(count, 1.0)
  return per_row.mean() if mask is None else batch_mean(per_row, mask)


class FedTypeClient(NamedTuple):
  """A client's extra state: params and state of its copy of the proxy (`global_model.Companion`'s fields) and
  thresholds [2], Qhat of the proxy and of the private model (set each round)."""
  params: dict
  state: dict
  thresholds: jnp.ndarray


def adam(cfg: FedTypeConfig) -> optax.GradientTransformation:
  """torch's Adam(lr, weight_decay): the decay added to the gradient before the moments."""
  return optax.chain(optax.add_decayed_weights(cfg.weight_decay), optax.adam(cfg.learning_rate))


def eval_logits(proxy_model, group: GroupSpec) -> tuple:
  """(proxy_logits(client, x), private_logits(client, x)): eval-mode logits of the client's copy of the proxy and of
  its private model."""
  proxy = lambda client, x: forward(proxy_model, client.extra.params['companion'],
                                    client.extra.state['companion'], x, False)[0]
  private = lambda client, x: forward(group.model, client.params, client.model_state, x, False)[0]
  return proxy, private


def calibrate(cfg: FedTypeConfig, group: GroupSpec, proxy_model, client: ClientState, rows, broadcast, key
              ) -> ClientState:
  """The received proxy; each model's Qhat on the client's training rows (step 0)."""
  client = receive_global_model(client, broadcast)
  real = jnp.arange(rows.y.shape[0]) < rows.num_train
  thresholds = []
  for logits_of, lam, k in zip(eval_logits(proxy_model, group), (PROXY_LAMBDA, PRIVATE_LAMBDA),
                               jax.random.split(key)):
    logits = jax.lax.map(lambda x: logits_of(client, x[None])[0], rows.x, batch_size=group.training.batch_size)
    u = jax.random.uniform(k, rows.y.shape)
    thresholds.append(conformal_threshold(raps_scores(logits, rows.y, u, RAPS_KREG, lam), real, cfg.alpha))
  return client._replace(extra=client.extra._replace(thresholds=jnp.stack(thresholds)))


def client_program(cfg: FedTypeConfig, num_classes: int, group: GroupSpec) -> ClientProgram:
  """A client's round (the module docstring): the received proxy and both models' conformal thresholds, then per
  epoch a pass of the private model and one of the proxy, each by its own Adam."""
  optimizer = adam(cfg)
  ranking = cfg.backward == 'ranking'
  proxy_model = group.build_model(cfg.proxy_model)
  proxy_logits, private_logits = eval_logits(proxy_model, group)

  def private_step(carry, batch, broadcast, key):
    """Step 1: w_k on CE + c R(w_k(x); S_p), p frozen."""
    client, private_opt, proxy_opt = carry
    if ranking:
      proxy_key, private_key = jax.random.split(key)
      u = lambda k: jax.random.uniform(k, batch.y.shape)
      qhat = client.extra.thresholds
      proxy_sets = raps_sets(proxy_logits(client, batch.x), qhat[0], u(proxy_key), RAPS_KREG, PROXY_LAMBDA)

    def loss(params):
      logits, _, state = forward(group.model, params, client.model_state, batch.x, True, batch.mask)
      value = cross_entropy(logits, batch.y, batch.mask)
      if ranking:
        private_sets = raps_sets(jax.lax.stop_gradient(logits), qhat[1], u(private_key), RAPS_KREG,
                                 PRIVATE_LAMBDA)
        c = consensus(proxy_sets, private_sets, batch.mask)
        value = value + c * ranking_loss(logits, proxy_sets, batch.mask)
      return value, state
    (value, state), grads = jax.value_and_grad(loss, has_aux=True)(client.params)
    updates, private_opt = optimizer.update(grads, private_opt, client.params)
    client = client._replace(params=optax.apply_updates(client.params, updates), model_state=state)
    return (client, private_opt, proxy_opt), value

  def proxy_step(carry, batch, broadcast, key):
    """Step 2: p on CE + KL(w_k || p) / C, w_k frozen."""
    client, private_opt, proxy_opt = carry
    teacher = private_logits(client, batch.x)

    def loss(params):
      logits, _, state = forward(proxy_model, params, client.extra.state['companion'], batch.x, True,
                                 batch.mask)
      kd = distillation_loss(logits, teacher, cfg.temperature, batch.mask) / num_classes  # KLDivLoss's mean
      return cross_entropy(logits, batch.y, batch.mask) + kd, state
    client, proxy_opt, value = global_model_step(client, loss, optimizer, proxy_opt)
    return (client, private_opt, proxy_opt), value

  def init(client, broadcast, key):
    client = receive_global_model(client, broadcast)
    return client, optimizer.init(client.params), optimizer.init(client.extra.params['companion'])

  stages = (Stage(private_step, 1), Stage(proxy_step, 1)) * group.training.epochs  # alternating per epoch
  return ClientProgram(init, stages, upload_carried_global_model, group.training,
                       prepare=lambda client, rows, broadcast, key: calibrate(cfg, group, proxy_model, client,
                                                                              rows, broadcast, key))


def proxy_evaluation(cfg: FedTypeConfig, group: GroupSpec) -> Evaluation:
  """'private': w_k; 'proxy': the client's copy of p with the broadcast parameters."""
  proxy_model = group.build_model(cfg.proxy_model)

  def prepare(client: ClientState, broadcast):
    return receive_global_model(client, broadcast)

  def logits(client, x):
    own = forward(group.model, client.params, client.model_state, x, False)[0]
    return own, forward(proxy_model, client.extra.params['companion'], client.extra.state['companion'], x,
                        False)[0]
  return Evaluation(('private', 'proxy'), prepare, logits)


def fedtype(cfg: FedTypeConfig, num_classes: int) -> Algorithm:
  """FedType as an `Algorithm` (each client carries its copy of the proxy in its per-client state)."""
  check_global_model(cfg)
  if cfg.proxy and cfg.proxy not in model_names():
    raise ConfigError(f'{setting(cfg, "proxy")} is not a registered model; choose one of {", ".join(model_names())}.')

  def init_client(group: GroupSpec, key):
    extra = init_global_model(group, group.build_model(cfg.proxy_model), key)
    return FedTypeClient(extra.params, extra.state, jnp.zeros(2))

  return one_phase('fedtype', initial_global_model, lambda group: client_program(cfg, num_classes, group),
                   average_global_models, lambda group: proxy_evaluation(cfg, group), init_client=init_client,
                   capabilities=Capabilities(partial_batches=True), upload_privacy=GLOBAL_MODEL_PRIVACY)
