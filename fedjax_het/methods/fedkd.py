"""FedKD, communication-efficient federated learning via knowledge distillation (Wu et al., Nature Comm. 2022, as
run in HtFLlib): a shared small mentee beside each client's own mentor, uploaded SVD-compressed.

Each client trains its own model (the mentor: logits z, representation r) and a copy of the global model (the
mentee: z_g, r_g; `global_model`, HtFLlib's 4-layer CNN) together with a local W_h (d x d, no bias). With the task
losses L_t = CE(z, y), L_s = CE(z_g, y) and S = L_t + L_s, the two losses are (paper Eqs. 1-6)
  mentor: L_t + KL(p_g || p) / S + MSE(r, W_h r_g) / S,
  mentee: L_s + KL(p || p_g) / S + MSE(r, W_h r_g) / S,
where KL is torch's KLDivLoss() (mean over batch and classes) and MSE the mean over batch and d. HtFLlib sums the
two losses' gradients into every part (two backward passes), which is what is done here: one loss, their sum,
minimised by SGD at the local rate for the mentor and W_h and at mentee_learning_rate for the mentee (an
optax.multi_transform; default 0.01, HtFLlib's `-mlr 0.01`). HtFLlib also clips each part's gradient norm
at 10, which is not done here.

Upload and broadcast are SVD-compressed (paper Sec. "Dynamic gradient approximation"): each weight matrix W
(a Dense kernel, or a convolution kernel viewed as the matrix [kh * kw * in, out]) keeps its K largest singular
values, K the smallest rank whose energy sum_{i<=K} s_i^2 reaches T * sum_i s_i^2; vectors are sent as they are.
T rises linearly from energy_start (0.95) in the first round to energy_end (0.98) at the last (--rounds). The
server averages the participants' reconstructed mentees, unweighted (HtFLlib), and compresses the average again
before broadcasting it. A client is scored with its own mentor.

Where HtFLlib differs (not reproduced):
  - its threshold search never keeps all singular values: when the energy target needs every one of them, it
    keeps none and the matrix is sent as zeros (e.g. a 10 x 512 head whose top 9 singular values hold < 95%);
  - it factors a convolution kernel per (out, in) channel pair as kh x kw matrices.
Communication is measured from what crosses: the scalars of U, s and V^T (or of W, when that is smaller) of every
matrix a participant uploads, and of the global model each participant receives at the start of its round (the
first round's is the uncompressed initial model, later ones the compressed average of the round before).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple
import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_het.core import Traffic, hyperparameter
from fedjax_het.errors import ConfigError, setting
from fedjax_het.methods.shared.base import Algorithm, local_head_evaluation, one_phase, sgd_program
from fedjax_het.methods.shared.common import elementwise_kl, train_forward
from fedjax_het.methods.shared.global_model import (check_global_model, global_model_forward, init_global_model,
                                                    initial_global_model, receive_global_model)


@dataclasses.dataclass(frozen=True)
class FedKDConfig:
  """energy_start, energy_end: SVD energy threshold T of the first and last round (HtFLlib's T_start 0.95,
  T_end 0.98); mentee_learning_rate: SGD rate of the mentee (HtFLlib's script: -mlr 0.01; None: the local
  rate); global_model: the mentee's architecture."""
  energy_start: float = hyperparameter(0.95, 'FedKD: SVD energy threshold of the first round.')
  energy_end: float = hyperparameter(0.98, 'FedKD: SVD energy threshold of the last round.')
  mentee_learning_rate: Optional[float] = hyperparameter(0.01, 'FedKD: SGD rate of the mentee (HtFLlib: -mlr 0.01).')
  global_model: str = hyperparameter('cnn4', 'Architecture of the small global model every client trains beside '
                                     'its own.')

  def __post_init__(self):
    if not (0 < self.energy_start <= 1 and 0 < self.energy_end <= 1):
      raise ConfigError(f'{setting(self, "energy_start")} and {setting(self, "energy_end")} must be in '
                        f'(0, 1].')
    if self.mentee_learning_rate is not None and self.mentee_learning_rate <= 0:
      raise ConfigError(f'{setting(self, "mentee_learning_rate")} must be > 0.')


def energy_threshold(cfg: FedKDConfig, round_index, rounds: int):
  """T of round `round_index` (0-based): energy_start + round_index / rounds * (energy_end - energy_start)."""
  return cfg.energy_start + round_index / max(rounds, 1) * (cfg.energy_end - cfg.energy_start)


def kept_rank(singular_values: jnp.ndarray, energy) -> jnp.ndarray:
  """The smallest K >= 1 with sum_{i<=K} s_i^2 >= energy * sum_i s_i^2 (s sorted descending)."""
  power = singular_values ** 2
  below = jnp.cumsum(power)[:-1] < energy * power.sum()
  return 1 + jnp.sum(below)


def compress_matrix(w: jnp.ndarray, energy) -> tuple[jnp.ndarray, jnp.ndarray]:
  """(the matrix rebuilt from its truncated SVD, scalars sent) for a 2-D w [m, n]: K (m + n + 1) for U, s, V^T,
  or m n when sending w itself is cheaper."""
  m, n = w.shape
  u, s, vt = jnp.linalg.svd(w, full_matrices=False)
  rank = kept_rank(s, energy)
  kept = jnp.where(jnp.arange(s.shape[0]) < rank, s, 0.0)
  return (u * kept) @ vt, jnp.minimum(rank * (m + n + 1), m * n)


def compress_params(params: Any, energy) -> tuple[Any, jnp.ndarray]:
  """`compress_matrix` on every parameter with >= 2 axes and both matrix sides > 1 (kernels [..., in, out] as
  [prod(...) * in, out]); other leaves are sent whole. Returns (rebuilt params, total scalars sent)."""
  leaves, treedef = jax.tree.flatten(params)
  rebuilt, total = [], jnp.asarray(0, jnp.int32)
  for leaf in leaves:
    rows = math.prod(leaf.shape[:-1]) if leaf.ndim >= 2 else 1
    if leaf.ndim >= 2 and rows > 1 and leaf.shape[-1] > 1:
      w, sent = compress_matrix(leaf.reshape(rows, leaf.shape[-1]), energy)
      rebuilt.append(w.reshape(leaf.shape))
      total = total + sent
    else:
      rebuilt.append(leaf)
      total = total + leaf.size
  return jax.tree.unflatten(treedef, rebuilt), total


def distillation_loss(logits, global_logits, rep, mapped_global_rep, y) -> jnp.ndarray:
  """The mentor's plus the mentee's loss of the module docstring (adaptive: the distillation and hidden terms
  are divided by the sum of the two task losses, gradient included)."""
  ce = lambda z: optax.softmax_cross_entropy_with_integer_labels(z, y).mean()
  task, task_g = ce(logits), ce(global_logits)
  total = task + task_g
  hidden = jnp.mean((rep - mapped_global_rep) ** 2) / total
  mentor = task + elementwise_kl(global_logits, logits) / total + hidden
  mentee = task_g + elementwise_kl(logits, global_logits) / total + hidden
  return mentor + mentee


class FedKDServer(NamedTuple):
  """FedKD's server: global_model, the mentee as last compressed (SVD at the round's energy); round, the rounds
  done; sent, the scalars of the compressed mentee (its factors)."""
  global_model: dict
  round: jnp.ndarray
  sent: jnp.ndarray


class FedKDBroadcast(NamedTuple):
  """What clients receive: the compressed mentee, its scalars, and the round's energy threshold."""
  global_model: dict
  sent: jnp.ndarray
  energy: jnp.ndarray


class MenteeUpload(NamedTuple):
  """A client's mentee compressed at the round's energy, and the scalars its factors take."""
  global_model: dict
  sent: jnp.ndarray


def fedkd(cfg: FedKDConfig, num_classes: int, rounds: int) -> Algorithm:
  """FedKD as an `Algorithm` (the mentee and W_h live in each client's per-client state)."""
  check_global_model(cfg)

  def init_client(group, key):
    extra = init_global_model(group, group.build_model(cfg.global_model), key)
    hidden_map = group.init_module(nn.Dense(group.feature_dim, use_bias=False), key,
                                   jnp.zeros((1, group.feature_dim)), name='hidden_map')['params']
    return extra._replace(params={**extra.params, 'hidden_map': hidden_map})

  def init_server(key, spec, initial):
    mentee = initial_global_model(key, spec, initial).global_model
    sent = sum(a.size for a in jax.tree.leaves(mentee))
    return FedKDServer(mentee, jnp.asarray(0, jnp.int32), jnp.asarray(sent, jnp.int32))

  def broadcast(server: FedKDServer, group) -> FedKDBroadcast:
    return FedKDBroadcast(server.global_model, server.sent, energy_threshold(cfg, server.round, rounds))

  def client(group):
    mentee = group.build_model(cfg.global_model)
    rate = group.training.learning_rate
    mentee_rate = rate if cfg.mentee_learning_rate is None else cfg.mentee_learning_rate
    # The mentee at its own SGD rate, the mentor and W_h at the local rate (trainable: (params, extra params)).
    labels = lambda t: (jax.tree.map(lambda _: 'local', t[0]),
                        {'companion': jax.tree.map(lambda _: 'mentee', t[1]['companion']),
                         'hidden_map': jax.tree.map(lambda _: 'local', t[1]['hidden_map'])})
    optimizer = optax.multi_transform({'local': optax.sgd(rate), 'mentee': optax.sgd(mentee_rate)}, labels)

    def loss(client, batch, broadcast, key):
      logits, rep, client = train_forward(group.model, client, batch.x)
      global_logits, global_rep, client = global_model_forward(mentee, client, batch.x)
      mapped = global_rep @ client.extra.params['hidden_map']['kernel']
      return distillation_loss(logits, global_logits, rep, mapped, batch.y), client

    def upload(client, rows, broadcast, key):
      return MenteeUpload(*compress_params(client.extra.params['companion'], broadcast.energy))
    return sgd_program(loss, group.training, receive=receive_global_model, upload=upload, optimizer=optimizer)

  def server_update(server, uploads, key):
    energy = energy_threshold(cfg, server.round, rounds)
    average = uploads.mean('global_model', previous=server.global_model)
    mentee, sent = compress_params(average, energy)
    return FedKDServer(mentee, server.round + 1, sent), {'energy': energy}

  return one_phase('fedkd', init_server, client, server_update, local_head_evaluation, broadcast=broadcast,
                   init_client=init_client, traffic=Traffic(lambda u: {'global_model': u.sent},
                                                            lambda b: {'global_model': b.sent}))
