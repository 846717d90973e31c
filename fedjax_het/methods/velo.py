"""Velo ("Exploiting Features and Logits in Heterogeneous Federated Learning", Alg. 2, Eq. 2): Felo whose server
replaces the averaged class features by ones a conditional VAE generates.

Clients are Felo's (`felo.adam_client_program`), except that they upload their individual training-mode features
with labels: the first --velo_upload_rows feature rows of their local steps (the code uploads all 10 x 50 = 500 of
its steps; a fixed-shape buffer with a mask here, counted honestly in the communication: d scalars per row).
The server pushes them into a per-class FIFO of --felo_feature_store features. Once the warm-up has ended, and then
every --velo_interval rounds, it trains the CVAE for --velo_epochs epochs over the whole store in batches of
--velo_batch_size with a fresh Adam (--velo_learning_rate) whose parameters persist across trainings; loss =
MSE(reconstruction, s) (mean over rows x d) + KL summed over the batch and the latent (the code; it dominates,
and near-collapse is expected). Each round after the first training the server draws one z ~ N(0, I) per
class from the round's key and broadcasts s^s_y = decoder(z_y, E(y)), the same vector to every client that round,
in place of the class mean (before it: the store's mean). Logits are Felo's.

CVAE (`FeatureCVAE`, the code's layers): a label embedding E(C, 512); encoder Linear(d + 512, 1024), BatchNorm1d,
ReLU, Linear(1024, 2 x 1024) -> (mu, logvar) of a 1024-d latent; decoder Linear(1024 + 512, d), Linear(d, d) with
no nonlinearity between them, so the decoder is affine in z. Widths are flags (small ones offline). Layers are
drawn as PyTorch draws them (Linear: U(+-1/sqrt(fan_in)); Embedding: N(0, 1)).

Rounds: one library round is one of the code's iterations; the code's interval of n paper-rounds is n x
int(0.01 x iterations) iterations: set --velo_interval to that.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_het.core import Algorithm, hyperparameter
from fedjax_het.errors import ConfigError, setting
from fedjax_het.generators.base import gaussian_kl
from fedjax_het.methods.felo import (FeatureChannel, FeloConfig, FeloRun, FeloServer, FIFOStore, class_uploads,
                                     empty_store, felo_family, push, store_mean, warmup_rounds)
from fedjax_het.methods.shared.common import fit_rows
from fedjax_het.models.init import torch_default_init
from fedjax_het.models.layers import Dense


@dataclasses.dataclass(frozen=True)
class VeloConfig(FeloConfig):
  """Velo's hyperparameters: Felo's plus the server CVAE's (the code's defaults)."""
  interval: int = hyperparameter(1, 'Velo: rounds between CVAE trainings after the warm-up.', flag='velo_interval')
  epochs: int = hyperparameter(10, 'Velo: CVAE epochs over the feature store per training.', flag='velo_epochs')
  batch_size: int = hyperparameter(50, 'Velo: CVAE batch size.', flag='velo_batch_size')
  cvae_learning_rate: float = hyperparameter(1e-3, 'Velo: the CVAE\'s Adam rate (a fresh Adam per training).',
                                             flag='velo_learning_rate')
  hidden: int = hyperparameter(1024, 'Velo: CVAE encoder width.', flag='velo_hidden')
  latent: int = hyperparameter(1024, 'Velo: CVAE latent size.', flag='velo_latent')
  embedding: int = hyperparameter(512, 'Velo: CVAE label-embedding size.', flag='velo_embedding')
  upload_rows: int = hyperparameter(500, 'Velo: feature rows a client uploads per round (its first steps\' rows).',
                                    flag='velo_upload_rows')

  def __post_init__(self):
    super().__post_init__()
    for name in ('interval', 'epochs', 'batch_size', 'hidden', 'latent', 'embedding', 'upload_rows'):
      if getattr(self, name) < 1:
        raise ConfigError(f'{setting(self, name)} must be >= 1.')
    if not self.cvae_learning_rate > 0:
      raise ConfigError(f'{setting(self, "cvae_learning_rate")} must be > 0.')


class FeatureCVAE(nn.Module):
  """Velo's conditional VAE on d-wide features (the code's layers)."""
  num_classes: int
  feature_dim: int
  hidden: int = 1024
  latent: int = 1024
  embedding: int = 512

  def setup(self):
    self.embed = nn.Embed(self.num_classes, self.embedding, embedding_init=nn.initializers.normal(1.0))
    self.encoder_in = Dense(self.hidden)
    self.encoder_norm = nn.BatchNorm(momentum=0.9, epsilon=1e-5)
    self.encoder_out = Dense(2 * self.latent)
    self.decoder_in = Dense(self.feature_dim)
    self.decoder_out = Dense(self.feature_dim)

  def __call__(self, s, y, eps, train: bool = True):
    """(reconstruction [B, d], mu [B, latent], logvar [B, latent]) of features s [B, d] of classes y [B]."""
    h = self.encoder_in(jnp.concatenate([s, self.embed(y)], axis=-1))
    h = nn.relu(self.encoder_norm(h, use_running_average=not train))
    mu, logvar = jnp.split(self.encoder_out(h), 2, axis=-1)
    return self.decode(mu + jnp.exp(0.5 * logvar) * eps, y), mu, logvar

  def decode(self, z, y):
    """decoder(z, E(y)) [B, d]: two Linear layers, no nonlinearity (affine in z)."""
    return self.decoder_out(self.decoder_in(jnp.concatenate([z, self.embed(y)], axis=-1)))


def cvae_loss(reconstruction, s, mu, logvar, weight) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Velo's loss over a batch with row weights (0 = padding): (MSE mean over the rows' entries + KL summed over
  rows and latent, the summed per-row loss)."""
  rows = jnp.maximum(weight.sum(), 1.0)
  mse_rows = jnp.mean((reconstruction - s) ** 2, axis=-1)
  kl_rows = jax.vmap(gaussian_kl)(mu, logvar)
  return jnp.sum(weight * mse_rows) / rows + jnp.sum(weight * kl_rows), jnp.sum(weight * (mse_rows + kl_rows))


@functools.partial(jax.jit, static_argnums=0)  # one program (eagerly, an op per layer)
def init_cvae(module: FeatureCVAE, key: jax.Array) -> dict:
  """The CVAE's variables, Linear layers drawn as PyTorch draws them."""
  variables = module.init(key, jnp.zeros((2, module.feature_dim)), jnp.zeros(2, jnp.int32),
                          jnp.zeros((2, module.latent)))
  return {**variables, 'params': torch_default_init(variables['params'], jax.random.fold_in(key, 1))}


def train_cvae(module: FeatureCVAE, variables: dict, store: FIFOStore, key: jax.Array, cfg: VeloConfig
               ) -> tuple[dict, jnp.ndarray]:
  """`cfg.epochs` epochs of a fresh Adam over every stored feature: (variables, mean per-row loss)."""
  num_classes, capacity, d = store.values.shape
  rows = store.values.reshape(num_classes * capacity, d)
  labels = jnp.repeat(jnp.arange(num_classes), capacity)
  filled = (jnp.arange(capacity)[None, :] < jnp.minimum(store.pushed, capacity)[:, None]).reshape(-1)

  def batch_loss(params, batch_stats, idx, weight, key):
    eps = jax.random.normal(key, (idx.shape[0], module.latent))
    (recon, mu, logvar), updated = module.apply({'params': params, 'batch_stats': batch_stats}, rows[idx],
                                                labels[idx], eps, True, mutable=['batch_stats'])
    loss, total = cvae_loss(recon, rows[idx], mu, logvar, weight)
    return loss, (updated['batch_stats'], total)

  params, stats, loss = fit_rows(variables['params'], variables['batch_stats'], batch_loss,
                                 filled.astype(jnp.float32), key, optax.adam(cfg.cvae_learning_rate),
                                 cfg.batch_size, cfg.epochs)
  return {'params': params, 'batch_stats': stats}, loss


def generated_features(module: FeatureCVAE, variables: dict, key: jax.Array) -> jnp.ndarray:
  """One feature per class, decoder(z_y, E(y)) with z_y ~ N(0, I) drawn from `key`: [C, d]."""
  z = jax.random.normal(key, (module.num_classes, module.latent))
  return module.apply(variables, z, jnp.arange(module.num_classes), method=FeatureCVAE.decode)


class FeatureRows(NamedTuple):
  """Velo's feature upload: rows [m, d], the client's first m training-mode feature rows, their labels [m] and
  valid [m] (whether the slot holds a row)."""
  rows: jnp.ndarray
  labels: jnp.ndarray
  valid: jnp.ndarray


class RowBuffer(NamedTuple):
  """What a Velo client gathers over its steps: the rows to upload and seen, how many rows its steps produced."""
  rows: FeatureRows
  seen: jnp.ndarray


def feature_rows(upload_rows: int, feature_dim: int):
  """(empty, gather) of the client's first `upload_rows` training-mode feature rows with their labels."""
  def empty():
    return RowBuffer(FeatureRows(jnp.zeros((upload_rows, feature_dim)), jnp.zeros(upload_rows, jnp.int32),
                                 jnp.zeros(upload_rows, bool)), jnp.zeros((), jnp.int32))

  def gather(buffer: RowBuffer, logits, features, labels):
    at = buffer.seen + jnp.arange(labels.shape[0])
    put = lambda slots, values: slots.at[at].set(values, mode='drop')  # rows past the buffer are not sent
    rows = buffer.rows
    return RowBuffer(FeatureRows(put(rows.rows, jax.lax.stop_gradient(features)), put(rows.labels, labels),
                                 put(rows.valid, jnp.ones(labels.shape, bool))), buffer.seen + labels.shape[0])
  return empty, gather


def cvae_module(run: FeloRun, feature_dim: int) -> FeatureCVAE:
  """The server's CVAE of the run's features."""
  cfg = run.cfg
  return FeatureCVAE(run.num_classes, feature_dim, cfg.hidden, cfg.latent, cfg.embedding)


class VeloChannel(NamedTuple):
  """Velo's feature channel on the server: store, a FIFO per class of uploaded feature rows; cvae, the CVAE's
  variables; trained, whether it has been trained yet."""
  store: FIFOStore
  cvae: dict
  trained: jnp.ndarray


def init_feature_server(run: FeloRun, spec, key: jax.Array) -> VeloChannel:
  """A FIFO per class of uploaded feature rows and an untrained CVAE."""
  return VeloChannel(empty_store(run.num_classes, run.cfg.feature_store, spec.feature_dim),
                     init_cvae(cvae_module(run, spec.feature_dim), jax.random.fold_in(key, 7)), jnp.zeros((), bool))


def feature_server(run: FeloRun, server: FeloServer, uploads, key: jax.Array) -> tuple[FeloServer, dict]:
  """Pushes the uploaded rows; after warm-up, every --velo_interval rounds, trains the CVAE on the store; once
  trained, the class features are its decodings (the stores' means before)."""
  cfg = run.cfg
  warm = warmup_rounds(cfg.warmup, run.rounds)
  u = class_uploads(uploads)
  rows = u.values.features
  k, m, d = rows.rows.shape
  valid = rows.valid & u.mask[:, None].astype(bool)
  store = push(server.channel.store, rows.rows.reshape(k * m, d), rows.labels.reshape(-1), valid.reshape(-1))
  cvae = cvae_module(run, d)
  train_key, draw_key = jax.random.split(key)
  done = server.round + 1                                      # rounds whose uploads the store now holds
  train = (done >= warm) & ((done - warm) % cfg.interval == 0)
  variables, loss = jax.lax.cond(train, lambda v: train_cvae(cvae, v, store, train_key, cfg),
                                 lambda v: (v, jnp.zeros(())), server.channel.cvae)
  trained = server.channel.trained | train
  means, present = store_mean(store)
  features = jnp.where(trained, generated_features(cvae, variables, draw_key), means)
  server = server._replace(channel=VeloChannel(store, variables, trained), features=features,
                           feature_present=jnp.where(trained, True, present))
  return server, {'cvae_loss': loss, 'cvae_trained': train.astype(jnp.float32)}


VELO_FEATURES = FeatureChannel(
    init_feature_server,
    lambda run, group: feature_rows(run.cfg.upload_rows, group.feature_dim),
    lambda stats: stats.channel.rows,
    feature_server,
    lambda rows: jnp.sum(rows.valid) * rows.rows.shape[-1])


def velo(cfg: VeloConfig, num_classes: int, rounds: int, num_clients: int) -> Algorithm:
  """Velo as an `Algorithm`: Felo's clients uploading feature rows, a server CVAE generating the class features."""
  return felo_family(FeloRun('velo', cfg, num_classes, rounds, num_clients, VELO_FEATURES))
