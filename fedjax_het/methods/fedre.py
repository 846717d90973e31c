"""FedRE: federated representation entanglement ("FedRE: A Representation Entanglement Framework for Model-Heterogeneous
Federated Learning", Alg. 1, Eq. 1-3, Appendix A Eq. 6-12).

Each round a participating client sets its head to the global head omega (Alg. 1 line 6; HtFLlib's released code
skips this, we follow the paper), trains on CE (Eq. 1), maps its training rows to representations r_i = RM(g(x_i))
in eval mode, entangles them into one (r~, y~) = sum_i w_i (r_i, onehot(y_i)) (Eq. 2/6), and uploads it. The
server trains omega on sum_k CE_soft(f(omega; r~_k), y~_k) (Eq. 3) and broadcasts it.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_het.core import Traffic, UploadPrivacy, hyperparameter
from fedjax_het.errors import ConfigError, setting
from fedjax_het.methods.shared.base import (Algorithm, ClientProgram, ClientRows, ClientState, GroupSpec, HeadServer,
                                            global_head_evaluation, initial_head, one_phase, receive_head, sgd_program)
from fedjax_het.methods.shared.common import (check_server_training, cross_entropy_loss, head_apply, sgd_on_rows,
                                              soft_cross_entropy)
from fedjax_het.rows import row_keys, row_uniform

MECHANISMS = ('rsr', 'var', 'rar', 'rsp', 'vap', 'rap')
DISTRIBUTIONS = ('uniform', 'gaussian', 'laplace')


@dataclasses.dataclass(frozen=True)
class FedREConfig:
  """FedRE hyperparameters (paper defaults: RAP, uniform weights re-sampled every round, server SGD 0.01/10/1).

  mechanism: RE mechanism (Appendix A): rsr, var, rar, rsp, vap, rap.
  weight_distribution: distribution of the random weights u (Table 7); signed ones use |u|.
  resample: draw new weights every round (RS); False draws them once per client (FS, Table 8).
  all_representations: FedAllRep (Q5): upload every r_i with its one-hot label instead of one entangled pair.
  server_loss_reduction: 'sum' over the server batch (reference code) or 'mean'.
  """
  mechanism: str = hyperparameter('rap', 'FedRE entanglement mechanism (Appendix A): rsr, var, rar, rsp, vap, rap.',
                                  're')
  weight_distribution: str = hyperparameter('uniform', 'FedRE random-weight distribution: uniform, gaussian, laplace.',
                                            're_distribution')
  resample: bool = hyperparameter(True, 'FedRE: re-sample the RE weights every round (False: fixed, Table 8).',
                                  're_resample')
  all_representations: bool = hyperparameter(False, 'FedAllRep: upload every representation (Q5).')
  server_learning_rate: float = hyperparameter(0.01, 'Server SGD learning rate.')
  server_batch_size: int = hyperparameter(10, 'Server batch size.')
  server_epochs: int = hyperparameter(1, 'Server epochs per round.')
  server_loss_reduction: str = hyperparameter('sum', 'FedRE server loss reduction: sum (reference code) or mean.')

  def __post_init__(self):
    if self.mechanism not in MECHANISMS:
      raise ConfigError(f'{setting(self, "mechanism")} is unknown; choose one of {", ".join(MECHANISMS)}.')
    if self.weight_distribution not in DISTRIBUTIONS:
      raise ConfigError(f'{setting(self, "weight_distribution")} is unknown; choose one of '
                        f'{", ".join(DISTRIBUTIONS)}.')
    if self.server_loss_reduction not in ('sum', 'mean'):
      raise ConfigError(f'{setting(self, "server_loss_reduction")}: choose sum or mean.')
    check_server_training(self)


class FedREUpload(NamedTuple):
  """A client's upload (Eq. 2): rep [rows, d], the entangled representation r~ as one row (every r_i for
  FedAllRep); label [rows, C], its soft label y~ (every one-hot label); weight [rows], 1 for a row sent (the
  server's bookkeeping of which rows are real)."""
  rep: jnp.ndarray
  label: jnp.ndarray
  weight: jnp.ndarray


def random_magnitudes(key: jax.Array, num: int, distribution: str) -> jnp.ndarray:
  """u_i ~ U(0,1), |N(0,1)| or |Laplace(0,1)| (FedRE Table 7), one per index i, keyed per index."""
  draw = {'uniform': jax.random.uniform, 'gaussian': jax.random.normal, 'laplace': jax.random.laplace}[distribution]
  return jnp.abs(jax.vmap(lambda k: draw(k))(row_keys(key, num)))


def entanglement_weights(labels: jnp.ndarray, valid: jnp.ndarray, num_classes: int, mechanism: str,
                         distribution: str, key: jax.Array) -> jnp.ndarray:
  """Per-sample weights w_i of Appendix A (Eq. 7-12) over rows [n_max]; padding rows get 0 and sum(w) = 1.

  rsr: one random sample (Eq. 7). var: 1/n (Eq. 8). rar: u_i / sum u (Eq. 9).
  Prototype mechanisms put a weight W_c on each present class and spread it as W_c / n_c over its samples:
  rsp: one random present class (Eq. 10); vap: W_c = 1/|K_k| (Eq. 11); rap: W_c = u_c / sum_{j in K_k} u_j (Eq. 12).
  """
  valid = valid.astype(jnp.float32)
  if mechanism == 'rsr':
    pick = jnp.argmax(jnp.where(valid > 0, row_uniform(key, valid.shape[0]), -1.0))
    return jax.nn.one_hot(pick, valid.shape[0]) * valid
  if mechanism == 'var':
    return valid / jnp.maximum(valid.sum(), 1.0)
  if mechanism == 'rar':
    u = random_magnitudes(key, valid.shape[0], distribution) * valid
    return u / jnp.maximum(u.sum(), 1e-12)
  counts = jnp.zeros(num_classes).at[labels].add(valid)
  present = (counts > 0).astype(jnp.float32)
  if mechanism == 'rsp':
    class_w = jax.nn.one_hot(jnp.argmax(jnp.where(present > 0, row_uniform(key, num_classes), -1.0)), num_classes)
  elif mechanism == 'vap':
    class_w = present / jnp.maximum(present.sum(), 1.0)
  else:
    u = random_magnitudes(key, num_classes, distribution) * present
    class_w = u / jnp.maximum(u.sum(), 1e-12)
  return (class_w / jnp.maximum(counts, 1.0))[labels] * valid


def entangle(reps: jnp.ndarray, labels: jnp.ndarray, weights: jnp.ndarray, num_classes: int
             ) -> tuple[jnp.ndarray, jnp.ndarray]:
  """(r~, y~) = (sum_i w_i r_i, sum_i w_i onehot(y_i)) (FedRE Eq. 2 / Eq. 6)."""
  return weights @ reps, weights @ jax.nn.one_hot(labels, num_classes, dtype=reps.dtype)


def train_head(head: dict, reps: jnp.ndarray, soft_labels: jnp.ndarray, row_weight: jnp.ndarray, rng: jax.Array,
               cfg: FedREConfig) -> tuple[dict, jnp.ndarray]:
  """Server step of Eq. 3: SGD on the sum (or mean) of CE_soft(f(omega; r~_k), y~_k) over shuffled batches of the
  weighted rows (`common.sgd_on_rows`)."""
  row_loss = lambda h, idx: soft_cross_entropy(head_apply(h, reps[idx]), soft_labels[idx])
  return sgd_on_rows(head, row_loss, row_weight, rng, cfg.server_learning_rate, cfg.server_batch_size,
                     cfg.server_epochs, cfg.server_loss_reduction)


def fedre_weights(cfg: FedREConfig, num_classes: int):
  """(client, rows, broadcast, key) -> the entanglement weights w [rows, 1] of the client's training rows (Eq. 6-12):
  they depend on the labels and the key only, so the engine can add up sum_i w_i r_i without keeping every r_i."""
  def weights(client: ClientState, rows: ClientRows, broadcast, key):
    valid = (jnp.arange(rows.y.shape[0]) < rows.n).astype(jnp.float32)
    key = key if cfg.resample else jax.random.fold_in(client.key, 0x52E)
    return entanglement_weights(rows.y, valid, num_classes, cfg.mechanism, cfg.weight_distribution, key)[:, None]
  return weights


def fedre_upload(cfg: FedREConfig, num_classes: int):
  """The client's upload (client, rows, broadcast, key) -> (r~_k, y~_k) of Eq. 2 as one row, rows.reps holding
  r~_k = sum_i w_i r_i (`fedre_weights`); or, for FedAllRep, every (r_i, onehot(y_i)) with rows.reps every r_i;
  'weight' marks the rows sent."""
  weights = fedre_weights(cfg, num_classes)

  def upload(client: ClientState, rows: ClientRows, broadcast, key) -> FedREUpload:
    reps, y, n = rows.reps, rows.y, rows.n
    if cfg.all_representations:
      valid = (jnp.arange(y.shape[0]) < n).astype(reps.dtype)
      return FedREUpload(reps, jax.nn.one_hot(y, num_classes, dtype=reps.dtype), valid)
    w = weights(client, rows, broadcast, key)[:, 0]
    soft = w @ jax.nn.one_hot(y, num_classes, dtype=reps.dtype)
    return FedREUpload(reps, soft[None], jnp.minimum(n, 1).astype(reps.dtype)[None])
  return upload


def fedre(cfg: FedREConfig, num_classes: int) -> Algorithm:
  """FedRE as an `Algorithm` (the FedRE paper's Alg. 1)."""

  upload = fedre_upload(cfg, num_classes)

  def client(group: GroupSpec) -> ClientProgram:
    """omega_k <- omega (Alg. 1 line 6), CE (Eq. 1), then the upload from eval-mode representations."""
    return sgd_program(cross_entropy_loss(group.model), group.training, receive=receive_head, upload=upload,
                       representations=True,
                       representation_weights=None if cfg.all_representations else fedre_weights(cfg, num_classes))

  def server_update(server, uploads, key):
    """Trains omega on the participants' rows (Eq. 3)."""
    u = uploads.every()
    rep = u.values.rep
    rows = rep.shape[0] * rep.shape[1]
    weight = (u.values.weight * u.weights().astype(rep.dtype)[:, None]).reshape(rows)
    head, loss = train_head(server.head, rep.reshape(rows, -1), u.values.label.reshape(rows, -1), weight, key, cfg)
    return HeadServer(head), {'server_loss': loss}

  def upload_scalars(upload):
    """d + C scalars per row sent: one row, or every training row for FedAllRep (Table 11); the row weights are
    the server's bookkeeping of which rows are real, not sent."""
    sent = jnp.sum(upload.weight > 0)
    return {'representation': sent * upload.rep.shape[-1], 'label': sent * num_classes}

  # DP: the representation is the client's contribution; its label encoding too with --dp_parts=label; the server
  # trains its head on each of a fixed number of uploads ('records'), which hides who took part once the label and
  # weight are private too (`privacy.dp.claims_amplification`). FedAllRep never does: how many rows the server
  # trains on depends on who was drawn.
  return one_phase('fedre', initial_head, client, server_update, global_head_evaluation,
                   traffic=Traffic(upload=upload_scalars),
                   upload_privacy=UploadPrivacy(public=('label', 'weight'),
                                                hides_participants=not cfg.all_representations))
