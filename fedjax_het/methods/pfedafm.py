"""pFedAFM (Yi, Yu, Wang, Liu and Li, ICDE 2025, "pFedAFM: adaptive feature mixture for batch-level
personalization in heterogeneous federated learning"), a baseline of FedVTC's Table 1
("Bridging Generalization Gap of Heterogeneous Federated Clients Using Generative Models", Sec. 4),
as its authors' code runs it (LipingYi/pFedAFM, `pFedAFM_mh.py`).

Every client holds its own model (extractor F_k with RM to d, head h_k), a copy of a small homogeneous global
extractor G (`--global_model` with RM to the same d) and a mixing vector alpha_k in [0, 1]^d kept across rounds
(ones at the start). Its prediction mixes the two representations entry by entry:
  o = alpha_k * F_k(x) + (1 - alpha_k) * G(x),   logits = h_k(o).
A round, after receiving G:
  1. --local_epochs epochs with G frozen: F_k, h_k and alpha_k on CE(h_k(o), y); F_k and h_k by SGD
     (--local_learning_rate, momentum --pfedafm_momentum, weight decay --pfedafm_weight_decay, gradients clipped
     to norm 50, a fresh optimizer every round), alpha_k by SGD at --pfedafm_alpha_learning_rate with the same
     momentum and decay, clamped to [0, 1] before and after each step;
  2. --local_epochs epochs with F_k and h_k frozen: G on CE(h_k(G(x)), y) (alpha 0), SGD with the same momentum
     and weight decay, clipped to 50.
It uploads G; the server averages the participants' copies weighted by their training rows. Scored: 'mixed', the
client's mixture with the global G it receives (the reported accuracy); 'global_extractor', h_k(G(x)).

Choices: the code keeps one optimizer object for every client's alpha (and one for G) across clients and rounds,
so their momentum carries from one client to the next; here each client keeps its alpha's momentum across rounds
and G's optimizer is fresh every round. G runs in eval mode while frozen (its BatchNorm statistics unchanged). The
code scores the mixture with the G received at the start of the round, before step 2; the engine scores after the
round, with the G the server has just averaged. The server weights G by training rows (the code counts a client's
train, validation and test rows). The code keeps each client's alpha as `ALPHA[node_id] = alpha`, the optimiser's
Parameter itself rather than a copy, so after their first rounds every client's entry is the one shared vector
and each client starts from the alpha the last trained client left: one alpha for the federation. The paper's
alpha_k is the client's own, and so is the library's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_het.core import Capabilities, ClientProgram, GroupSpec, Stage, hyperparameter
from fedjax_het.errors import ConfigError, setting
from fedjax_het.methods.shared.base import Algorithm, ClientState, Evaluation, one_phase
from fedjax_het.methods.shared.common import cross_entropy, head_apply
from fedjax_het.methods.shared.global_model import (GLOBAL_MODEL_PRIVACY, check_global_model, global_model_step,
                                                    init_global_model, initial_global_model, receive_global_model,
                                                    upload_carried_global_model)
from fedjax_het.models.forward import forward

CLIP_NORM = 50.0  # the code clips every model's gradients to this norm


@dataclasses.dataclass(frozen=True)
class PFedAFMConfig:
  """pFedAFM's mixing and optimisers (its code's defaults)."""
  global_model: str = hyperparameter('cnn4', 'Architecture of the small global model every client trains beside '
                                     'its own.')
  alpha_learning_rate: float = hyperparameter(0.01, 'pFedAFM: SGD rate of each client\'s mixing weights alpha.',
                                              flag='pfedafm_alpha_learning_rate')
  momentum: float = hyperparameter(0.9, 'pFedAFM: SGD momentum of every optimiser.', flag='pfedafm_momentum')
  weight_decay: float = hyperparameter(1e-3, 'pFedAFM: weight decay of the local model, alpha and G.',
                                       flag='pfedafm_weight_decay')

  def __post_init__(self):
    if self.alpha_learning_rate <= 0 or not 0 <= self.momentum < 1 or self.weight_decay < 0:
      raise ConfigError(f'{setting(self, "alpha_learning_rate")} must be > 0, {setting(self, "momentum")} in [0, 1) '
                        f'and {setting(self, "weight_decay")} >= 0.')


def mix(alpha: jnp.ndarray, own: jnp.ndarray, shared: jnp.ndarray) -> jnp.ndarray:
  """o = alpha * own + (1 - alpha) * shared, entry by entry (pFedAFM's feature mixture)."""
  return alpha * own + (1.0 - alpha) * shared


def sgd(learning_rate: float, momentum: float, weight_decay: float = 0.0) -> optax.GradientTransformation:
  """torch's SGD(momentum, weight_decay) after clip_grad_norm_(50), as the code steps each model."""
  return optax.chain(optax.clip_by_global_norm(CLIP_NORM), optax.add_decayed_weights(weight_decay),
                     optax.sgd(learning_rate, momentum=momentum or None))


def alpha_optimizer(cfg: PFedAFMConfig) -> optax.GradientTransformation:
  """alpha's optimiser, as the code's optimizer_alpha: torch SGD with momentum and weight decay."""
  return optax.chain(optax.add_decayed_weights(cfg.weight_decay),
                     optax.sgd(cfg.alpha_learning_rate, momentum=cfg.momentum or None))


class PFedAFMClient(NamedTuple):
  """A client's extra state: params and state of its copy of G (`global_model.Companion`'s fields), alpha [d],
  its mixing weights, and alpha_optimizer, their optimizer's state (both kept across rounds)."""
  params: dict
  state: dict
  alpha: jnp.ndarray
  alpha_optimizer: Any


def optimizers(cfg: PFedAFMConfig, learning_rate: float) -> tuple[optax.GradientTransformation, ...]:
  """(the client's own model's, alpha's, G's) optimisers, as the code builds them: torch SGD with momentum and
  weight decay for all three (its optimizer_large, optimizer_alpha, optimizer_small), the two models' gradients
  clipped to 50; the models' at the client's local rate."""
  own = sgd(learning_rate, cfg.momentum, cfg.weight_decay)
  return own, alpha_optimizer(cfg), sgd(learning_rate, cfg.momentum, cfg.weight_decay)


def clamp(alpha: jnp.ndarray) -> jnp.ndarray:
  """alpha clamped to [0, 1], as the code clamps it before and after each step."""
  return jnp.clip(alpha, 0.0, 1.0)


def client_program(cfg: PFedAFMConfig, group: GroupSpec) -> ClientProgram:
  """A client's round (the module docstring): receive G, step 1 (F_k, h_k and alpha, G frozen), step 2 (G, F_k and
  h_k frozen), upload G; the models step at the group's local rate (`LocalTraining.learning_rate`)."""
  own_opt, alpha_opt, shared_opt = optimizers(cfg, group.training.learning_rate)
  shared_model = group.build_model(cfg.global_model, group.feature_dim)

  def mixture_step(carry, batch, broadcast, key):
    """Step 1: F_k, h_k and alpha on CE(h_k(o), y), G frozen."""
    client, own_state, shared_state = carry
    extra = client.extra
    _, shared, _ = forward(shared_model, extra.params['companion'], extra.state['companion'], batch.x, False)

    def loss(values):
      params, alpha = values
      _, own, model_state = forward(group.model, params, client.model_state, batch.x, True, batch.mask)
      logits = head_apply(params['head'], mix(alpha, own, shared))
      return cross_entropy(logits, batch.y, batch.mask), model_state
    alpha = clamp(extra.alpha)
    (value, model_state), (g_params, g_alpha) = jax.value_and_grad(loss, has_aux=True)((client.params, alpha))
    updates, own_state = own_opt.update(g_params, own_state, client.params)
    a_updates, alpha_state = alpha_opt.update(g_alpha, extra.alpha_optimizer, alpha)
    client = client._replace(params=optax.apply_updates(client.params, updates), model_state=model_state,
                             extra=extra._replace(alpha=clamp(optax.apply_updates(alpha, a_updates)),
                                                  alpha_optimizer=alpha_state))
    return (client, own_state, shared_state), value

  def shared_step(carry, batch, broadcast, key):
    """Step 2: G on CE(h_k(G(x)), y), F_k and h_k frozen."""
    client, own_state, shared_state = carry

    def loss(params):
      _, shared, state = forward(shared_model, params, client.extra.state['companion'], batch.x, True,
                                 batch.mask)
      return cross_entropy(head_apply(client.params['head'], shared), batch.y, batch.mask), state
    client, shared_state, value = global_model_step(client, loss, shared_opt, shared_state)
    return (client, own_state, shared_state), value

  def init(client, broadcast, key):
    client = receive_global_model(client, broadcast)
    return client, own_opt.init(client.params), shared_opt.init(client.extra.params['companion'])

  epochs = group.training.epochs
  return ClientProgram(init, (Stage(mixture_step, epochs), Stage(shared_step, epochs)), upload_carried_global_model,
                       group.training)


def mixture_evaluation(cfg: PFedAFMConfig, group: GroupSpec) -> Evaluation:
  """'mixed': h_k(alpha o F_k + (1 - alpha) o G) with the broadcast G; 'global_extractor': h_k(G(x))."""
  shared_model = group.build_model(cfg.global_model, group.feature_dim)

  def prepare(client: ClientState, broadcast):
    return receive_global_model(client, broadcast)

  def logits(client, x):
    _, own, _ = forward(group.model, client.params, client.model_state, x, False)
    _, shared, _ = forward(shared_model, client.extra.params['companion'], client.extra.state['companion'],
                           x, False)
    head = client.params['head']
    return head_apply(head, mix(clamp(client.extra.alpha), own, shared)), head_apply(head, shared)
  return Evaluation(('mixed', 'global_extractor'), prepare, logits)


def pfedafm(cfg: PFedAFMConfig) -> Algorithm:
  """pFedAFM as an `Algorithm` (clients carry G and alpha in their per-client state)."""
  check_global_model(cfg)
  alpha_opt = alpha_optimizer(cfg)

  def init_client(group: GroupSpec, key):
    extra = init_global_model(group, group.build_model(cfg.global_model, group.feature_dim), key)
    alpha = jnp.ones(group.feature_dim)
    return PFedAFMClient(extra.params, extra.state, alpha, alpha_opt.init(alpha))

  def server_update(server, uploads, key):
    """G averaged over the participants, weighted by their training rows."""
    return server._replace(global_model=uploads.mean('global_model', by='rows', previous=server.global_model)), {}

  return one_phase('pfedafm', initial_global_model, lambda group: client_program(cfg, group),
                   server_update, lambda group: mixture_evaluation(cfg, group), init_client=init_client,
                   capabilities=Capabilities(partial_batches=True), upload_privacy=GLOBAL_MODEL_PRIVACY)
