"""Math shared by methods: masked means, class prototypes and their aggregation, (soft-label) cross-entropy, the
linear head, server-side SGD over uploaded rows, FedAvg."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax

from fedjax_het.core import UploadPrivacy, parts
from fedjax_het.errors import ConfigError, setting
from fedjax_het.models.forward import forward
from fedjax_het.rows import batch_mean, shuffled_real_rows


def class_prototypes(reps: jnp.ndarray, labels: jnp.ndarray, valid: jnp.ndarray, num_classes: int
                     ) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Per-class means of reps [n, d] over valid rows: (prototypes [C, d] (0 for absent classes), counts [C])."""
  onehot = jax.nn.one_hot(labels, num_classes, dtype=reps.dtype) * valid[:, None].astype(reps.dtype)
  counts = onehot.sum(0)
  return (onehot.T @ reps) / jnp.maximum(counts, 1.0)[:, None], counts


def class_sums(values: jnp.ndarray, labels: jnp.ndarray, num_classes: int) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Per-class sums of values [B, d] and counts over one batch: ([C, d], [C]); the training-pass statistics of
  FedProto's prototypes and FD's logits (summed over the local steps by the engine)."""
  onehot = jax.nn.one_hot(labels, num_classes, dtype=values.dtype)
  return onehot.T @ jax.lax.stop_gradient(values), onehot.sum(0)


def class_means_from_sums(sums: tuple[jnp.ndarray, jnp.ndarray]) -> tuple[jnp.ndarray, jnp.ndarray]:
  """(means [C, d] (0 for absent classes), counts [C]) from summed `class_sums`."""
  total, counts = sums
  return total / jnp.maximum(counts, 1.0)[:, None], counts


def soft_cross_entropy(logits: jnp.ndarray, soft_labels: jnp.ndarray) -> jnp.ndarray:
  """Per-row -sum_c y_c log softmax(z)_c (FedRE Eq. 3 with entangled labels)."""
  return -jnp.sum(soft_labels * jax.nn.log_softmax(logits, axis=-1), axis=-1)


def train_forward(model, client, x: jnp.ndarray, mask: Optional[jnp.ndarray] = None
                  ) -> tuple[jnp.ndarray, jnp.ndarray, Any]:
  """Training-mode (logits, representations, client with updated BatchNorm statistics) of the client's own
  classifier on x; mask [B]: the real rows of a padded partial batch (BatchNorm counts only them)."""
  logits, reps, model_state = forward(model, client.params, client.model_state, x, True, mask)
  return logits, reps, client._replace(model_state=model_state)


def cross_entropy(logits: jnp.ndarray, labels: jnp.ndarray, mask: Optional[jnp.ndarray] = None) -> jnp.ndarray:
  """Mean CE of integer labels over a batch (torch's CrossEntropyLoss), over its real rows when mask is given."""
  return batch_mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels), mask)


def cross_entropy_loss(model):
  """The loss (client, batch, broadcast, key) -> (mean CE of the client's classifier on the batch's real rows,
  the client with updated BatchNorm statistics) (FedRE Eq. 1)."""
  def loss(client, batch, broadcast, key):
    logits, _, client = train_forward(model, client, batch.x, batch.mask)
    return cross_entropy(logits, batch.y, batch.mask), client
  return loss


def elementwise_kl(target_logits: jnp.ndarray, logits: jnp.ndarray, rows: jnp.ndarray | None = None
                   ) -> jnp.ndarray:
  """torch KLDivLoss()(log_softmax(logits), softmax(target_logits)) as HtFLlib's FML and FedKD (and Felo's code)
  use it: the mean over batch AND classes of q (log q - log p), q = softmax(target_logits), p = softmax(logits);
  rows [B] (optional) zeroes the terms of rows without a target, which still count in the mean."""
  log_q, log_p = jax.nn.log_softmax(target_logits, -1), jax.nn.log_softmax(logits, -1)
  terms = jnp.exp(log_q) * (log_q - log_p)
  if rows is not None:
    terms = terms * rows.astype(terms.dtype)[:, None]
  return jnp.mean(terms)


def distillation_loss(student_logits: jnp.ndarray, teacher_logits: jnp.ndarray, temperature: float,
                      rows: Optional[jnp.ndarray] = None) -> jnp.ndarray:
  """KL(softmax(t/T) || softmax(s/T)) summed over classes, averaged over the batch (torch's kl_div with
  reduction='batchmean': FedDF's, FedGKT's without its T^2); rows [B] (optional): average over these rows only."""
  log_q = jax.nn.log_softmax(teacher_logits / temperature, -1)
  log_p = jax.nn.log_softmax(student_logits / temperature, -1)
  per_row = jnp.sum(jnp.exp(log_q) * (log_q - log_p), -1)
  if rows is None:
    return per_row.mean()
  rows = rows.astype(per_row.dtype)
  return jnp.sum(per_row * rows) / jnp.maximum(rows.sum(), 1.0)


def head_apply(head: dict, r: jnp.ndarray) -> jnp.ndarray:
  """The linear head f(omega; r) = r W + b (flax Dense layout: kernel [d, C], bias [C])."""
  return r @ head['kernel'] + head['bias']


def prototype_regularizer(reps: jnp.ndarray, labels: jnp.ndarray, protos: jnp.ndarray, present: jnp.ndarray
                          ) -> jnp.ndarray:
  """FedProto's client term (Eq. 8, HtFLlib's MSELoss): mean over the batch and d of (r_i - P_{y_i})^2, where rows
  whose class has no global prototype contribute 0 (HtFLlib copies r_i there) but still count in the mean."""
  has = present[labels].astype(reps.dtype)[:, None]
  return jnp.mean(has * (reps - protos[labels]) ** 2)


def nearest_prototype_head(protos: jnp.ndarray, present: jnp.ndarray) -> dict:
  """A linear head whose argmax is the nearest prototype in Euclidean distance (FedProto's test rule):
  -||r - P_c||^2 = 2 r.P_c - ||P_c||^2 - ||r||^2, and -||r||^2 is the same for every class. Classes without a
  prototype get a bias of -inf-like magnitude, so they are never predicted while any prototype exists."""
  bias = jnp.where(present, -jnp.sum(protos ** 2, axis=-1), -1e30)
  return {'kernel': 2.0 * protos.T, 'bias': bias}


def descend(optimizer: optax.GradientTransformation, params: Any, grads: Any) -> Any:
  """params after one update of a stateless optax optimizer (plain SGD: `LocalTraining.optimizer`), built afresh
  for the update; a stateless optimizer built once per loop takes the same steps."""
  updates, _ = optimizer.update(grads, optimizer.init(params), params)
  return optax.apply_updates(params, updates)


def fit_rows(params: Any, state: Any, batch_loss: Callable, row_weight: jnp.ndarray, rng: jax.Array,
             optimizer: optax.GradientTransformation, batch_size: int, epochs: int
             ) -> tuple[Any, Any, jnp.ndarray]:
  """Minibatch training over rows held in memory (the server-side loops of FedRE, FedGH, FedTGP, CCVR, Velo).

  batch_loss(params, state, idx, weight, key) -> (loss, (state, total)): idx [batch_size] row indices (clipped to
  the rows), weight [batch_size] their weights (0 for padding), key the step's key; state is carried non-trainable
  state (BatchNorm statistics; None when there is none) and total the batch's summed per-row loss. Each epoch
  visits the rows with weight > 0 once in a fresh random order, in batches of `batch_size` (the last one may be
  smaller, like a DataLoader without drop_last); rows with weight 0 (absent participants, padding) sort last and
  never contribute; a batch of them only is skipped. A fresh `optimizer` state is built. Returns (params, state,
  mean per-row loss over all epochs).
  """
  rows = row_weight.shape[0]
  steps = math.ceil(rows / batch_size)
  pad = steps * batch_size - rows
  weight = jnp.pad(row_weight, (0, pad))

  def epoch(carry, e):
    epoch_key = jax.random.fold_in(rng, e)
    order = shuffled_real_rows(epoch_key, weight > 0).reshape(steps, batch_size)

    def step(carry, s_idx):
      s, idx = s_idx
      p, opt_state, st = carry
      w = weight[idx]
      grads, (st_new, total) = jax.grad(batch_loss, has_aux=True)(p, st, jnp.minimum(idx, rows - 1), w,
                                                                  jax.random.fold_in(epoch_key, s))
      updates, opt_state = optimizer.update(grads, opt_state, p)
      # A batch of weight-0 rows only is no step (momentum and weight decay would still move the parameters).
      new = (optax.apply_updates(p, updates), opt_state, st_new)
      return jax.tree.map(lambda a, b: jnp.where(w.sum() > 0, a, b), new, carry), total
    carry, totals = jax.lax.scan(step, carry, (jnp.arange(steps), order))
    return carry, totals.sum()

  (params, _, state), totals = jax.lax.scan(epoch, (params, optimizer.init(params), state), jnp.arange(epochs))
  return params, state, totals.sum() / jnp.maximum(row_weight.sum() * max(epochs, 1), 1.0)


def check_server_training(cfg) -> None:
  """A ConfigError unless the method config's server SGD settings can run: server_batch_size >= 1,
  server_epochs >= 0, server_learning_rate > 0 (None, where a config allows it, takes the local value)."""
  for field, bound, holds in (('server_batch_size', '>= 1', lambda v: v >= 1),
                             ('server_epochs', '>= 0', lambda v: v >= 0),
                             ('server_learning_rate', '> 0', lambda v: v > 0)):
    value = getattr(cfg, field)
    if value is not None and not holds(value):
      raise ConfigError(f'{setting(cfg, field)} must be {bound}.')


def sgd_on_rows(params: Any, row_loss: Callable[[Any, jnp.ndarray], jnp.ndarray], row_weight: jnp.ndarray,
                rng: jax.Array, learning_rate: float, batch_size: int, epochs: int, reduction: str = 'mean',
                momentum: float = 0.0, weight_decay: float = 0.0) -> tuple[Any, jnp.ndarray]:
  """SGD over rows held in memory (FedRE Eq. 3, FedGH's head, FedTGP's prototype generator on the server; CCVR's
  calibration on virtual features): `fit_rows` with torch's SGD (heavy-ball `momentum`, L2 `weight_decay` added to
  the gradient) and a batch loss that is the weighted 'sum' or 'mean' of row_loss(params, idx) -> per-row losses
  [len(idx)]. Returns (params, mean per-row loss over all epochs).
  """
  def batch_loss(p, state, idx, w, key):
    total = jnp.sum(row_loss(p, idx) * w)
    return (total if reduction == 'sum' else total / jnp.maximum(w.sum(), 1.0)), (state, total)

  optimizer = optax.sgd(learning_rate, momentum or None)
  if weight_decay:
    optimizer = optax.chain(optax.add_decayed_weights(weight_decay), optimizer)
  params, _, loss = fit_rows(params, None, batch_loss, row_weight, rng, optimizer, batch_size, epochs)
  return params, loss


def cosine_similarity(a: jnp.ndarray, b: jnp.ndarray, eps: float = 1e-8) -> jnp.ndarray:
  """[n, m] cosine similarities of the rows of a [n, d] and b [m, d] (torch's: a.b / max(|a| |b|, eps))."""
  norms = jnp.linalg.norm(a, axis=-1)[:, None] * jnp.linalg.norm(b, axis=-1)[None, :]
  return (a @ b.T) / jnp.maximum(norms, eps)


def class_means_privacy(part: str, aggregate: str = 'sum') -> UploadPrivacy:
  """The DP view of an upload {part: [C, ...] per-class means, 'counts': [C] rows per class}: the means are the
  client's contribution; a client contributes to the classes it holds (counts > 0), each averaged over its holders
  by the server ('sum'; 'records' for a server that trains on each upload). The counts are public: they leak which
  classes a client holds, and how many rows of each (docs/privacy.md)."""
  return UploadPrivacy(public=('counts',), holds=lambda u: {part: (parts(u)['counts'] > 0)[:, None]},
                       aggregate=aggregate)
