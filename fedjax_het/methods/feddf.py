"""FedDF (Lin et al. 2020, "Ensemble distillation for robust model fusion in federated learning"), as GeFL's Table
II runs it ("GeFL: Model-Agnostic Federated Learning with Generative Models", Sec. V, Appendix: unlabelled public data
at the server, SVHN for MNIST, CIFAR-10 for FMNIST, CIFAR-100 for CIFAR-10: --public_dataset).

Clients train their architecture's model on their own data (CE, the run's local SGD) and upload it (parameters and
BatchNorm statistics). The server, per round:
  1. averages each architecture's uploads uniformly (the paper's code, `_avg_over_archs`);
  2. distils into each averaged model whose architecture took part: --feddf_server_steps steps of Adam
     (--feddf_server_learning_rate, cosine-annealed to 0 over the steps, gradients clipped to norm 5) on batches of
     --feddf_server_batch_size unlabelled public rows (a fresh permutation each pass), minimising
       KL(softmax(t / T) || softmax(s / T)),  t = the mean of the logits of every uploaded client model
     (all architectures, eval mode), s = the student's logits (training mode), T = --feddf_temperature; the
     KL summed over classes and averaged over the batch (torch's kl_div with reduction='batchmean').
Each architecture's distilled model is what its clients start from and are scored with.

Choices (the paper's code, epfml/federated-learning-public-code, where GeFL gives no setting): Adam 1e-3, T 1,
batch 64, clip 5, cosine annealing over --feddf_server_steps; --feddf_public_augment=crop_flip crops (padding 4, the
run's black pixel) and flips each public batch as the code's CIFAR loaders do (off by default; GeFL's Table II files
with CIFAR public data set it). The code's early stopping (`--feddf_patience`, its
README's 1,000; off by default): every --feddf_eval_every (100) steps each student's top-1 accuracy on the server's
labelled validation rows (`--server_validation_size`, held out of the training rows: the code's val_data_ratio
split, 10 %) is measured; an architecture stops when that many steps have passed since its best, and keeps its best
student (the code's best_models), at most --feddf_server_steps (its 10,000) steps. Without it the step count is
fixed (default 500) and the last student is kept.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from fedjax_het.core import Algorithm, Capabilities, FederationSpec, Phase, hyperparameter
from fedjax_het.data.augment import augment_batch
from fedjax_het.data.federated import PublicData
from fedjax_het.errors import ConfigError, setting
from fedjax_het.methods.avgkd import (GROUP_STATE_PRIVACY, GroupStates, average_group_states, group_state_evaluation,
                                      initial_group_states, model_upload, own_group_state, receive_group_state)
from fedjax_het.methods.shared.base import sgd_program
from fedjax_het.methods.shared.common import cross_entropy_loss, distillation_loss
from fedjax_het.methods.shared.public import PublicRows, PublicSet, public_logits
from fedjax_het.models.forward import forward

CLIP_NORM = 5.0  # the paper's code clips the student's gradients to this norm
AUGMENT_STREAM = 0x444641  # folded into the server's key for the public batches' augmentation


@dataclasses.dataclass(frozen=True)
class FedDFConfig:
  """FedDF's server distillation (the paper's code's defaults, a fixed step count in place of early stopping)."""
  server_steps: int = hyperparameter(500, 'FedDF: distillation steps per architecture and round at the server.',
                                     flag='feddf_server_steps')
  server_learning_rate: float = hyperparameter(1e-3, 'FedDF: the server\'s Adam rate (cosine-annealed to 0).',
                                               flag='feddf_server_learning_rate')
  server_batch_size: int = hyperparameter(64, 'FedDF: public rows per distillation step.',
                                          flag='feddf_server_batch_size')
  temperature: float = hyperparameter(1.0, 'FedDF: distillation temperature T.', flag='feddf_temperature')
  patience: int = hyperparameter(0, 'FedDF: stop an architecture\'s distillation this many steps after its best '
                                    'validation accuracy and keep that student (the code\'s early stopping: 1,000; '
                                    'needs --server_validation_size); 0: every step, the last student.',
                                 flag='feddf_patience')
  eval_every: int = hyperparameter(100, 'FedDF: distillation steps between validations (the code\'s '
                                        'eval_batches_freq).', flag='feddf_eval_every')
  public_augment: str = hyperparameter('none', "FedDF: augmentation of each public distillation batch, seen alike by "
                                               "the teacher and the student: 'crop_flip' (its code's CIFAR loaders: "
                                               "random flip and crop with padding 4) or 'none'.",
                                       flag='feddf_public_augment')

  def __post_init__(self):
    if self.server_steps < 0 or self.server_batch_size < 1:
      raise ConfigError(f'{setting(self, "server_steps")} must be >= 0 and {setting(self, "server_batch_size")} '
                        f'>= 1.')
    if self.patience < 0 or self.eval_every < 1:
      raise ConfigError(f'{setting(self, "patience")} must be >= 0 and {setting(self, "eval_every")} >= 1.')
    if self.public_augment not in ('none', 'crop_flip'):
      raise ConfigError(f'{setting(self, "public_augment")}: choose none or crop_flip.')
    if not (self.server_learning_rate > 0 and self.temperature > 0):
      raise ConfigError(f'{setting(self, "server_learning_rate")} and {setting(self, "temperature")} must be > 0.')


def ensemble_logits(spec: FederationSpec, uploads, x: jnp.ndarray) -> jnp.ndarray:
  """[B, C] the mean over every participant of every group of its uploaded model's eval-mode logits on x."""
  total, count = 0.0, 0.0
  for group, u in zip(spec.groups, uploads):
    logits = jax.vmap(lambda p, s: forward(group.model, p, s, x, False)[0])(u.values.model, u.values.model_state)
    mask = u.mask.astype(logits.dtype)
    total, count = total + jnp.einsum('s,sbc->bc', mask, logits), count + mask.sum()
  return total / jnp.maximum(count, 1.0)


def validation_accuracy(group, params: Any, state: Any, validation: PublicSet) -> jnp.ndarray:
  """Top-1 accuracy of a group's model (eval mode) on the server's labelled validation rows."""
  logits = public_logits(group.model, params, state, validation.x)
  return jnp.mean((jnp.argmax(logits, -1) == validation.y).astype(jnp.float32))


def early_stopped(cfg: FedDFConfig, spec: FederationSpec, step, init: tuple, validation: PublicSet) -> tuple:
  """(params, BatchNorm states) per group after distilling from `init` = (params, states, optimizer states) with
  `step(t, carry, active)` the code's way: after every `eval_every`-th step each still active student is scored on
  the validation rows, its best kept; a group stops once `patience` steps have passed since its best, or at
  `server_steps`; each ends with its best student (the initial one if it was never scored)."""
  groups = len(spec.groups)
  score = lambda params, states: jnp.stack([validation_accuracy(g, p, s, validation)
                                            for g, p, s in zip(spec.groups, params, states)])

  def chunk(loop):
    t, carry, best, best_accuracy, best_t, active = loop
    end = jnp.minimum(t + cfg.eval_every, cfg.server_steps)
    carry = jax.lax.fori_loop(t, end, lambda i, c: step(i, c, active), carry)
    scored = end % cfg.eval_every == 0
    accuracy = score(carry[0], carry[1])
    better = active & scored & (accuracy > best_accuracy)
    best = tuple(jax.tree.map(lambda new, old, b=better[g]: jnp.where(b, new, old), (carry[0][g], carry[1][g]),
                              best[g]) for g in range(groups))
    best_t = jnp.where(better, end, best_t)
    active = active & ~(scored & (end - best_t >= cfg.patience)) & (end < cfg.server_steps)
    return end, carry, best, jnp.where(better, accuracy, best_accuracy), best_t, active

  loop = (jnp.asarray(0), init, tuple(zip(init[0], init[1])), jnp.full(groups, -1.0), jnp.zeros(groups, jnp.int32),
          jnp.ones(groups, bool))
  loop = jax.lax.while_loop(lambda loop: (loop[0] < cfg.server_steps) & loop[5].any(), chunk, loop)
  best = loop[2]
  return tuple(b[0] for b in best), tuple(b[1] for b in best)


def server_optimizer(cfg: FedDFConfig) -> optax.GradientTransformation:
  """The student's optimiser: gradients clipped to 5, Adam with its rate cosine-annealed over the server steps."""
  return optax.chain(optax.clip_by_global_norm(CLIP_NORM),
                     optax.adam(optax.cosine_decay_schedule(cfg.server_learning_rate, max(cfg.server_steps, 1)),
                                eps=1e-8))


def distillation_step(cfg: FedDFConfig, spec: FederationSpec, uploads, public_x: jnp.ndarray, key: jax.Array,
                      batch: int):
  """step(t, (params, states, optimizer states) per group, active=None): distillation step t of every group's
  student on public batch t (a fresh permutation of the public rows each pass), towards the mean logits of every
  upload; a group not `active` stays as it is."""
  optimizer = server_optimizer(cfg)
  size = public_x.shape[0]
  per_pass = size // batch

  def step(t, carry, active=None):
    params, states, opt_states = carry
    order = jax.random.permutation(jax.random.fold_in(key, t // per_pass), size)
    x = public_x[jax.lax.dynamic_slice_in_dim(order, (t % per_pass) * batch, batch)]
    # the code's public loader crops and flips each batch; teacher and student read the same augmented rows
    x = augment_batch(x, jax.random.fold_in(jax.random.fold_in(key, AUGMENT_STREAM), t), cfg.public_augment,
                      spec.training.augment_fill)
    teacher = jax.lax.stop_gradient(ensemble_logits(spec, uploads, x))
    out = []
    for gi, (group, p, s, o) in enumerate(zip(spec.groups, params, states, opt_states)):
      def objective(p):
        logits, _, new_state = forward(group.model, p, s, x, True)
        return distillation_loss(logits, teacher, cfg.temperature), new_state
      (_, new_state), grads = jax.value_and_grad(objective, has_aux=True)(p)
      updates, new_o = optimizer.update(grads, o, p)
      new = (optax.apply_updates(p, updates), new_state, new_o)
      if active is not None:  # a stopped student stays as it is
        new = jax.tree.map(lambda a, b: jnp.where(active[gi], a, b), new, (p, s, o))
      out.append(new)
    return tuple(tuple(v) for v in zip(*out))
  return step


class ServerRows(NamedTuple):
  """FedDF's constants: the public rows it distils on and, under early stopping, its labelled validation rows
  (else None)."""
  public: PublicSet
  validation: Optional[PublicSet] = None


def server_constants(cfg: FedDFConfig, public: PublicData) -> ServerRows:
  """The server's arrays: the public images, and under early stopping the labelled validation rows."""
  rows = ServerRows(PublicRows(public).constants)
  if cfg.patience:
    if public.validation_x is None:
      raise ConfigError(f'{setting(cfg, "patience")}: FedDF stops early on the server\'s labelled '
                        f'validation rows, and this run holds none. Fix: --server_validation_size=N (the code: 10 % '
                        f'of the training rows), or no early stopping (patience 0).')
    rows = rows._replace(validation=PublicSet(jnp.asarray(public.validation_x),
                                              jnp.asarray(public.validation_y, jnp.int32)))
  return rows


def feddf(cfg: FedDFConfig, num_classes: int, public: PublicData) -> Algorithm:
  """FedDF as an `Algorithm`: grouped local training, the server's ensemble distillation into each
  architecture's model on public data (with the code's early stopping on labelled validation rows)."""
  constants = server_constants(cfg, public)
  batch = min(cfg.server_batch_size, int(public.y.shape[0]))
  optimizer = server_optimizer(cfg)

  def client(group):
    return sgd_program(cross_entropy_loss(group.model), group.training, receive=receive_group_state,
                       upload=model_upload)

  def server_for(spec: FederationSpec):
    def server_update(server: GroupStates, uploads, key, rows: ServerRows):
      averaged, states = average_group_states(server, uploads, by='uniform')
      present = tuple(u.mask.any() for u in uploads)
      step = distillation_step(cfg, spec, uploads, rows.public.x, key, batch)
      init = (averaged, states, tuple(optimizer.init(p) for p in averaged))
      if cfg.patience:
        distilled, new_states = early_stopped(cfg, spec, step, init, rows.validation)
      else:
        distilled, new_states, _ = jax.lax.fori_loop(0, cfg.server_steps, step, init)
      keep = lambda flag, new, old: jax.tree.map(lambda a, b: jnp.where(flag, a, b), new, old)
      models = tuple(keep(f, d, a) for f, d, a in zip(present, distilled, averaged))
      model_states = tuple(keep(f, d, a) for f, d, a in zip(present, new_states, states))
      return GroupStates(models, model_states), {}
    return server_update

  return Algorithm('feddf', initial_group_states,
                   (Phase('feddf', client, server_for, own_group_state, server_of_spec=True),), group_state_evaluation,
                   capabilities=Capabilities(partial_batches=True, shares_representations=False), constants=constants,
                   # the ensemble reads each uploaded model on its own, not only the groups' means
                   upload_privacy=GROUP_STATE_PRIVACY._replace(aggregate='records'))
