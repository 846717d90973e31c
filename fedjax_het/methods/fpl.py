"""FPL, federated prototype learning (Huang et al., CVPR 2023, "Rethinking federated learning with domain shift:
a prototype view"), in the model-heterogeneous setting of FedRE's comparison.

Clients upload class prototypes as in FedProto. For each class the server clusters the participants' prototypes
with FINCH (cosine; `finch.finch`) and broadcasts the cluster means (the "cluster prototypes" P_c^j); the
class's unbiased prototype is the mean of its cluster prototypes, U_c = mean_j P_c^j. A client's loss is
  CE + (1/B) sum_{i: y_i has prototypes} [ L_FPCL(r_i) + MSE(r_i, U_{y_i}) ],
  L_FPCL(r) = -log( sum_j exp(cos(r, P_y^j)/tau) / sum_{c, j} exp(cos(r, P_c^j)/tau) )   (paper Eqs. 5-8),
tau = 0.02, with MSE the mean over d, divided by the batch size B as in the reference code (RethinkFL's
fpl.py). No model is averaged (the architectures differ); a client is scored with its own model.

Prototypes come from the eval-mode representation pass after local training (the reference code averages the
training-mode features of the last local epoch; not reproduced). Local SGD is the engine's plain SGD without
momentum, as HtFLlib runs every method; RethinkFL trains FPL's clients with momentum 0.9 and weight decay 1e-5,
which is not offered here. The broadcast is measured: one d-vector per cluster prototype (FedRE Table 11 counts
FPL this way).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_het.core import Traffic, hyperparameter
from fedjax_het.errors import ConfigError, setting
from fedjax_het.methods.fedproto import prototype_upload, prototypes_sent
from fedjax_het.methods.shared.base import Algorithm, local_head_evaluation, one_phase, sgd_program
from fedjax_het.methods.shared.common import class_means_privacy, cosine_similarity, cross_entropy, train_forward
from fedjax_het.methods.shared.finch import cluster_means, finch


@dataclasses.dataclass(frozen=True)
class FPLConfig:
  """temperature: tau of the cluster-prototype InfoNCE (RethinkFL's infoNCET, 0.02)."""
  temperature: float = hyperparameter(0.02, 'FPL: temperature of the cluster-prototype InfoNCE.',
                                       'fpl_temperature')

  def __post_init__(self):
    if self.temperature <= 0:
      raise ConfigError(f'{setting(self, "temperature")} must be > 0.')


def cluster_prototypes(protos: jnp.ndarray, holds: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Server step for one class: FINCH over the prototypes [K, d] of the clients that hold it (holds [K]) ->
  (cluster prototypes [K, d] at the representatives' rows, valid [K])."""
  labels = finch(protos, holds)
  return cluster_means(protos, labels, holds), holds & (labels == jnp.arange(protos.shape[0]))


def unbiased_prototypes(clusters: jnp.ndarray, valid: jnp.ndarray) -> jnp.ndarray:
  """U_c = the unweighted mean of class c's cluster prototypes: clusters [C, K, d], valid [C, K] -> [C, d]."""
  w = valid.astype(clusters.dtype)
  return jnp.einsum('ck,ckd->cd', w, clusters) / jnp.maximum(w.sum(1), 1.0)[:, None]


def fpl_regularizer(reps: jnp.ndarray, labels: jnp.ndarray, clusters: jnp.ndarray, valid: jnp.ndarray,
                    temperature: float) -> jnp.ndarray:
  """(1/B) sum over rows whose class has cluster prototypes of L_FPCL + MSE to U_y (module docstring)."""
  num_classes, k, d = clusters.shape
  flat, flat_valid = clusters.reshape(num_classes * k, d), valid.reshape(num_classes * k)
  logits = jnp.where(flat_valid[None, :], cosine_similarity(reps, flat) / temperature, -jnp.inf)
  positive = (jnp.repeat(jnp.arange(num_classes), k)[None, :] == labels[:, None]) & flat_valid[None, :]
  has = valid.any(1)[labels]
  info = jax.nn.logsumexp(logits, axis=1) - jax.nn.logsumexp(jnp.where(positive, logits, -jnp.inf), axis=1)
  mse = jnp.mean((reps - unbiased_prototypes(clusters, valid)[labels]) ** 2, axis=1)
  return jnp.sum(jnp.where(has, info + mse, 0.0)) / reps.shape[0]


def compact_clusters(clusters: jnp.ndarray, valid: jnp.ndarray, size: int) -> tuple[jnp.ndarray, jnp.ndarray]:
  """One class's cluster prototypes [K, d] (valid [K]) moved to the first rows of a [size, d] array (size must be
  at least the number of valid rows), so the server state keeps one shape whatever the upload slots."""
  k = clusters.shape[0]
  if k < size:
    clusters, valid = jnp.pad(clusters, ((0, size - k), (0, 0))), jnp.pad(valid, (0, size - k))
  order = jnp.argsort(~valid, stable=True)[:size]
  return clusters[order], valid[order]


class ClusterPrototypes(NamedTuple):
  """FPL's server state, and broadcast: clusters [C, slots, d], each class's cluster prototypes in its first
  slots; valid [C, slots], which slots hold one."""
  clusters: jnp.ndarray
  valid: jnp.ndarray


def fpl(cfg: FPLConfig, num_classes: int, num_clients: int) -> Algorithm:
  """FPL as an `Algorithm`; a class has at most one cluster per client, so the server keeps num_clients slots
  per class."""

  def init_server(key, spec, initial):
    return ClusterPrototypes(jnp.zeros((num_classes, num_clients, spec.feature_dim)),
                             jnp.zeros((num_classes, num_clients), bool))

  def client(group):
    def loss(client, batch, broadcast, key):
      logits, reps, client = train_forward(group.model, client, batch.x)
      reg = fpl_regularizer(reps, batch.y, broadcast.clusters, broadcast.valid, cfg.temperature)
      return cross_entropy(logits, batch.y) + reg, client
    return sgd_program(loss, group.training, upload=prototype_upload(num_classes), representations=True)

  def server_update(server, uploads, key):
    u = uploads.every()
    holds = u.holds()  # [K, C]
    clusters, valid = jax.vmap(cluster_prototypes, in_axes=(1, 1))(u.values.protos, holds)  # [C, K, ...]
    clusters, valid = jax.vmap(lambda c, v: compact_clusters(c, v, num_clients))(clusters, valid)
    return ClusterPrototypes(clusters, valid), {'cluster_prototypes': valid.sum()}

  def clusters_sent(broadcast):
    """The valid cluster prototypes, d scalars each."""
    return {'cluster_prototypes': jnp.sum(broadcast.valid) * broadcast.clusters.shape[-1]}

  return one_phase('fpl', init_server, client, server_update, local_head_evaluation,
                   traffic=Traffic(prototypes_sent, clusters_sent),
                   upload_privacy=class_means_privacy('protos', 'records'))
