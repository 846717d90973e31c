"""CCVR, classifier calibration with virtual representations (Luo et al., NeurIPS 2021), for heterogeneous models.

Clients train their own models on CE (as Local) and upload, per class they hold, the mean mu_ck, the unbiased
covariance Sigma_ck of their eval-mode representations and the count N_ck. The server forms each class's global
Gaussian (paper Eqs. 3-4):
  mu_c    = sum_k N_ck / N_c mu_ck,
  Sigma_c = sum_k (N_ck - 1)/(N_c - 1) Sigma_ck + sum_k N_ck/(N_c - 1) mu_ck mu_ck^T - N_c/(N_c - 1) mu_c mu_c^T,
and samples M_c virtual representations per class from N(mu_c, Sigma_c). Calibration re-trains a classifier on
them with CE (torch SGD with momentum 0.9 and weight decay 1e-5, lr 0.001, 10 epochs, batches of the local batch
size). The paper calibrates the one global classifier once, after training; with heterogeneous models every
client has its own head, so each client's head is calibrated on the shared virtual set, post hoc: the reported
accuracy ('calibrated') is that of the client's extractor with its calibrated head, and local training goes on
from the uncalibrated model, as in the paper. The uncalibrated head is logged as 'local_head'.

Communication: the upload is d + d(d+1)/2 scalars (a mean and a symmetric covariance) per class held, plus the
C counts; the broadcast is the C global Gaussians, d + d(d+1)/2 each. In this simulation the server draws the
virtual set once per round and hands it to every client, which is equivalent to each client drawing it from
the broadcast Gaussians with a shared seed.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_het.core import Traffic, hyperparameter
from fedjax_het.errors import ConfigError, setting
from fedjax_het.methods.shared.base import Algorithm, ClientState, head_evaluation, one_phase, own_head, sgd_program
from fedjax_het.methods.shared.common import class_prototypes, cross_entropy_loss, head_apply, sgd_on_rows


@dataclasses.dataclass(frozen=True)
class CCVRConfig:
  """virtual_per_class: M_c; calibration_learning_rate, calibration_epochs, momentum, weight_decay: the
  calibration's SGD; batch size: the local one."""
  virtual_per_class: int = hyperparameter(2000, 'CCVR: virtual representations sampled per class.',
                                          'ccvr_virtual_per_class')
  calibration_learning_rate: float = hyperparameter(0.001, 'CCVR: SGD rate of the calibration.',
                                                    'ccvr_calibration_learning_rate')
  calibration_epochs: int = hyperparameter(10, 'CCVR: calibration epochs.', 'ccvr_calibration_epochs')
  momentum: float = hyperparameter(0.9, 'CCVR: momentum of the calibration SGD.', 'ccvr_momentum')
  weight_decay: float = hyperparameter(1e-5, 'CCVR: weight decay of the calibration SGD.', 'ccvr_weight_decay')

  def __post_init__(self):
    if self.virtual_per_class < 1 or self.calibration_epochs < 0:
      raise ConfigError(f'{setting(self, "virtual_per_class")} must be >= 1 and '
                        f'{setting(self, "calibration_epochs")} >= 0.')
    if self.calibration_learning_rate <= 0:
      raise ConfigError(f'{setting(self, "calibration_learning_rate")} must be > 0.')


def class_statistics(reps: jnp.ndarray, labels: jnp.ndarray, valid: jnp.ndarray, num_classes: int
                     ) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
  """Per class: (means [C, d], unbiased covariances [C, d, d] (0 with fewer than 2 rows), counts [C])."""
  means, counts = class_prototypes(reps, labels, valid, num_classes)
  onehot = jax.nn.one_hot(labels, num_classes, dtype=reps.dtype) * valid[:, None].astype(reps.dtype)
  centred = reps[None, :, :] - means[:, None, :]  # [C, n, d]
  scatter = jnp.einsum('nc,cnd,cne->cde', onehot, centred, centred)
  return means, scatter / jnp.maximum(counts - 1.0, 1.0)[:, None, None], counts


def global_gaussians(means: jnp.ndarray, covs: jnp.ndarray, counts: jnp.ndarray
                     ) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
  """CCVR Eqs. 3-4 over clients: means [K, C, d], covs [K, C, d, d], counts [K, C] (0 for absent clients) ->
  (mu [C, d], Sigma [C, d, d] (0 where N_c < 2), N [C])."""
  total = counts.sum(0)
  mu = jnp.einsum('kc,kcd->cd', counts, means) / jnp.maximum(total, 1.0)[:, None]
  denom = jnp.maximum(total - 1.0, 1.0)[:, None, None]
  sigma = (jnp.einsum('kc,kcde->cde', jnp.maximum(counts - 1.0, 0.0), covs)
           + jnp.einsum('kc,kcd,kce->cde', counts, means, means)
           - total[:, None, None] * jnp.einsum('cd,ce->cde', mu, mu)) / denom
  return mu, jnp.where((total > 1)[:, None, None], sigma, 0.0), total


def sample_virtual(rng: jax.Array, mu: jnp.ndarray, sigma: jnp.ndarray, per_class: int) -> jnp.ndarray:
  """[C, M, d] draws from N(mu_c, Sigma_c): mu + eps S with S = Q diag(sqrt(lambda)) Q^T, Sigma's symmetric
  square root (eigenvalues clipped at 0, so a covariance that is PSD only up to rounding still works). Unlike a
  Cholesky factor it exists for singular covariances (fewer rows than d), and unlike Q diag(sqrt(lambda)) it is a
  continuous function of Sigma, so covariances equal up to rounding give samples equal up to rounding."""
  def one_class(key, m, s):
    lam, q = jnp.linalg.eigh(s)
    root = (q * jnp.sqrt(jnp.maximum(lam, 0.0))) @ q.T
    return m + jax.random.normal(key, (per_class, m.shape[0]), m.dtype) @ root
  return jax.vmap(one_class)(jax.random.split(rng, mu.shape[0]), mu, sigma)


def calibrate_head(head: dict, virtual: jnp.ndarray, present: jnp.ndarray, rng: jax.Array, cfg: CCVRConfig,
                   batch_size: int) -> dict:
  """The head re-trained with CE on the virtual set [C, M, d] of the classes present (paper Sec. 4.2)."""
  num_classes, per_class, d = virtual.shape
  rows = virtual.reshape(num_classes * per_class, d)
  labels = jnp.repeat(jnp.arange(num_classes), per_class)
  weight = jnp.repeat(present, per_class).astype(jnp.float32)
  row_loss = lambda h, idx: optax.softmax_cross_entropy_with_integer_labels(head_apply(h, rows[idx]), labels[idx])
  head, _ = sgd_on_rows(head, row_loss, weight, rng, cfg.calibration_learning_rate, batch_size,
                        cfg.calibration_epochs, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
  return head


def gaussian_scalars(d) -> int:
  """A mean and a symmetric covariance in R^d: d + d(d+1)/2 scalars."""
  return d + d * (d + 1) // 2


class ClassGaussians(NamedTuple):
  """A client's upload: per-class means [C, d] and covariances [C, d, d] of its representations, and counts [C]."""
  means: jnp.ndarray
  covs: jnp.ndarray
  counts: jnp.ndarray


class VirtualSet(NamedTuple):
  """The server state, and broadcast: virtual [C, M, d], M virtual representations per class drawn from the global
  Gaussians; present [C], the classes that have one; key, whose fold with a client's key draws its calibration."""
  virtual: jnp.ndarray
  present: jnp.ndarray
  key: jax.Array


def ccvr(cfg: CCVRConfig, num_classes: int) -> Algorithm:
  """CCVR as an `Algorithm`."""

  def init_server(key, spec, initial):
    return VirtualSet(jnp.zeros((num_classes, cfg.virtual_per_class, spec.feature_dim)),
                      jnp.zeros(num_classes, bool), key)

  def upload(client: ClientState, rows, broadcast, key) -> ClassGaussians:
    return ClassGaussians(*class_statistics(rows.reps, rows.y, jnp.arange(rows.y.shape[0]) < rows.n, num_classes))

  def client(group):
    return sgd_program(cross_entropy_loss(group.model), group.training, upload=upload, representations=True)

  def server_update(server, uploads, key):
    u = uploads.every()
    counts = u.values.counts * u.weights()[:, None]
    mu, sigma, total = global_gaussians(u.values.means, u.values.covs, counts)
    sample_key, next_key = jax.random.split(key)
    return (VirtualSet(sample_virtual(sample_key, mu, sigma, cfg.virtual_per_class), total > 0, next_key),
            {'global_classes': jnp.sum(total > 0)})

  def evaluation(group):
    """Reported: the calibrated head; also logged: the uncalibrated one (calibration runs once per client and
    evaluation, in `Evaluation.prepare`)."""
    def calibrated(client: ClientState, broadcast) -> dict:
      """The client's head calibrated on the virtual set in batches of the run's batch size (its own head where
      no class has one yet)."""
      return calibrate_head(client.params['head'], broadcast.virtual, broadcast.present,
                            jax.random.fold_in(broadcast.key, client.key[-1]), cfg, group.training.batch_size)
    return head_evaluation(group.model, {'calibrated': calibrated, 'local_head': own_head})

  def upload_scalars(u):
    """A Gaussian per class held, plus the C counts."""
    d = u.means.shape[-1]
    return {'class_gaussians': jnp.sum(u.counts > 0) * gaussian_scalars(d), 'class_counts': u.counts.size}

  def broadcast_scalars(b):
    """The C global Gaussians (the virtual set is drawn from them with a shared seed)."""
    return {'class_gaussians': num_classes * gaussian_scalars(b.virtual.shape[-1])}

  return one_phase('ccvr', init_server, client, server_update, evaluation,
                   traffic=Traffic(upload_scalars, broadcast_scalars))
