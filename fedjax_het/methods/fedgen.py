"""FedGen (Zhu et al., ICML 2021) in HtFLlib's heterogeneous form: a server generator in representation space.

The server keeps a global head (the sample-weighted mean of the participants' heads, as LG-FedAvg) and a
conditional generator G(eps, y) = W2 ReLU(BN(W1 [eps, onehot(y)])) with eps ~ U(0, 1)^noise_dim (HtFLlib draws
torch.rand). After each round it trains G for `server_epochs` Adam steps so that the ensemble of the uploaded heads,
weighted by training samples, classifies G's outputs: CE(sum_k w_k head_k(G(eps, y)), y), labels drawn from the
participants' training-label distribution. Clients set their head to the global head and train on
CE(f(x), y) + CE(head(G(eps, y')), y') with y' from the same distribution.

HtFLlib trains the generator but never saves it, so its clients always use the untrained initial generator;
here the trained G is broadcast (and counted in the broadcast). The generator's Adam state starts
fresh every round, as in HtFLlib. The label distribution is HtFLlib's: computed once, before the first round, from
all clients' training labels as their train loaders yield them (`FederatedData.loader_label_counts`), and fixed
thereafter; it is handed to the server and the clients at construction, so it is not counted per round.
Defaults are HtFLlib's tuned script (`total.sh`: -nd 32 -glr 0.1 -hd 512 -se 100).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_het.core import FederationSpec, Phase, Traffic, hyperparameter
from fedjax_het.errors import ConfigError, setting
from fedjax_het.local_training import LocalTraining
from fedjax_het.methods.lg_fedavg import upload_head
from fedjax_het.methods.shared.base import Algorithm, global_head_evaluation, receive_head, sgd_program
from fedjax_het.methods.shared.common import cross_entropy, cross_entropy_loss, head_apply
from fedjax_het.models.init import torch_default_init
from fedjax_het.models.layers import Dense
from fedjax_het.models.norm import TorchBatchNorm
from fedjax_het.uploads import participant_average


@dataclasses.dataclass(frozen=True)
class FedGenConfig:
  """HtFLlib's tuned script: noise 32, hidden 512, Adam 0.1, 100 generator steps per round; batches of the local
  batch size (None) for both the server steps and the clients' generated batch."""
  noise_dim: int = hyperparameter(32, 'FedGen: width of the generator\'s noise.')
  hidden_dim: int = hyperparameter(512, 'FedGen: width of the generator\'s hidden layer.', 'generator_hidden_dim')
  generator_learning_rate: float = hyperparameter(0.1, 'FedGen: Adam learning rate of the server generator.')
  server_epochs: int = hyperparameter(100, 'Server epochs per round.')
  generator_batch_size: Optional[int] = hyperparameter(None, 'FedGen: generated batch size (default: the local '
                                                       'batch size).')

  def __post_init__(self):
    if min(self.noise_dim, self.hidden_dim) < 1 or self.server_epochs < 0 or self.generator_learning_rate <= 0:
      raise ConfigError(f'{setting(self, "noise_dim")} and {setting(self, "hidden_dim")} must be >= 1, '
                        f'{setting(self, "server_epochs")} >= 0 and {setting(self, "generator_learning_rate")} > 0.')


class FeatureGenerator(nn.Module):
  """G(eps, y): [eps, onehot(y)] -> Dense(hidden) -> BatchNorm -> ReLU -> Dense(d)."""
  num_classes: int
  feature_dim: int
  hidden_dim: int

  @nn.compact
  def __call__(self, noise: jnp.ndarray, labels: jnp.ndarray, train: bool = True) -> jnp.ndarray:
    h = Dense(self.hidden_dim)(jnp.concatenate([noise, jax.nn.one_hot(labels, self.num_classes)], -1))
    h = nn.relu(TorchBatchNorm(use_running_average=not train)(h))
    return Dense(self.feature_dim)(h)


def ensemble_logits(heads: dict, weights: jnp.ndarray, z: jnp.ndarray) -> jnp.ndarray:
  """sum_k w_k (z W_k + b_k) over the uploaded heads (leading axis k), weights already normalised."""
  return jnp.einsum('k,kbc->bc', weights, jnp.einsum('bd,kdc->kbc', z, heads['kernel']) + heads['bias'][:, None])


class GeneratedDraws(NamedTuple):
  """What the server's and the clients' generated batches draw from: `batch_size` labels from `label_probs` [C],
  and noise of width cfg.noise_dim (`batch_size` None until `under` sets the run's)."""
  cfg: FedGenConfig
  num_classes: int
  label_probs: jnp.ndarray
  batch_size: Optional[int] = None

  def under(self, training: LocalTraining) -> 'GeneratedDraws':
    """These draws in batches of cfg.generator_batch_size, or of the local batch size of `training`."""
    return self._replace(batch_size=self.cfg.generator_batch_size or training.batch_size)

  def labels(self, key: jax.Array) -> jnp.ndarray:
    """[batch_size] labels drawn from the training-label distribution."""
    return jax.random.choice(key, self.num_classes, (self.batch_size,), p=self.label_probs)

  def generator(self, feature_dim: int) -> FeatureGenerator:
    return FeatureGenerator(self.num_classes, feature_dim, self.cfg.hidden_dim)

  def generate(self, variables: dict, feature_dim: int, labels: jnp.ndarray, key: jax.Array):
    """(G(eps, y) in training mode, its updated BatchNorm statistics), eps ~ U(0, 1)^noise_dim."""
    noise = jax.random.uniform(key, (labels.shape[0], self.cfg.noise_dim))
    return self.generator(feature_dim).apply(variables, noise, labels, mutable=['batch_stats'])


class FedGenServer(NamedTuple):
  """FedGen's server state, and broadcast: the global head's params and G's variables ({'params', 'batch_stats'})."""
  head: dict
  generator: dict


def label_distribution(num_classes: int, label_counts: Optional[np.ndarray]) -> jnp.ndarray:
  """[C] the distribution of generated labels: the counts normalised, uniform for None."""
  if label_counts is None:
    return jnp.full(num_classes, 1.0 / num_classes, jnp.float32)
  label_counts = np.asarray(label_counts, np.float64)
  if label_counts.shape != (num_classes,) or label_counts.min() < 0 or label_counts.sum() <= 0:
    raise ConfigError(f'fedgen: label_counts must be {num_classes} non-negative counts with a positive sum; got '
                      f'{label_counts}.')
  return jnp.asarray(label_counts / label_counts.sum(), jnp.float32)


def init_server(draws: GeneratedDraws, key: jax.Array, spec, initial) -> FedGenServer:
  """The first client's head and G with PyTorch's default initialisation."""
  generator = draws.generator(spec.feature_dim)

  @jax.jit  # one program (eagerly, an op per layer)
  def init_generator(key):
    variables = generator.init(key, jnp.zeros((2, draws.cfg.noise_dim)), jnp.zeros(2, jnp.int32))
    return {**variables, 'params': torch_default_init(variables['params'], key)}
  return FedGenServer(initial[0].params['head'], init_generator(key))


def client_program(draws: GeneratedDraws, group):
  """head <- global head; CE(f(x), y) + CE(head(G(eps, y')), y') with G's output a constant; uploads the head."""
  draws = draws.under(group.training)

  def loss(client, batch, broadcast, key):
    value, client = cross_entropy_loss(group.model)(client, batch, broadcast, key)
    label_key, noise_key = jax.random.split(key)
    labels = draws.labels(label_key)
    z, _ = draws.generate(broadcast.generator, group.feature_dim, labels, noise_key)
    logits = head_apply(client.params['head'], jax.lax.stop_gradient(z))
    return value + cross_entropy(logits, labels), client
  return sgd_program(loss, group.training, receive=receive_head, upload=upload_head)


def server_update(draws: GeneratedDraws, spec: FederationSpec):
  """The server step: `train_generator` on batches of the run's size."""
  return functools.partial(train_generator, draws.under(spec.training))


def train_generator(draws: GeneratedDraws, server: FedGenServer, uploads, key: jax.Array) -> tuple[FedGenServer, dict]:
  """Trains G for server_epochs Adam steps (fresh state) against the sample-weighted ensemble of the uploaded
  heads, then averages the heads."""
  cfg = draws.cfg
  u = uploads.every()
  weights = u.weights('rows')
  w = weights / jnp.maximum(weights.sum(), 1e-12)
  d = server.head['kernel'].shape[0]
  optimizer = optax.adam(cfg.generator_learning_rate, b1=0.9, b2=0.999, eps=1e-8)

  def step(carry, step_key):
    variables, opt_state = carry
    label_key, noise_key = jax.random.split(step_key)
    labels = draws.labels(label_key)

    def loss_fn(params):
      z, updated = draws.generate({**variables, 'params': params}, d, labels, noise_key)
      return cross_entropy(ensemble_logits(u.values.head, w, z), labels), updated
    (loss, updated), grads = jax.value_and_grad(loss_fn, has_aux=True)(variables['params'])
    updates, opt_state = optimizer.update(grads, opt_state, variables['params'])
    variables = {**variables, **updated, 'params': optax.apply_updates(variables['params'], updates)}
    return (variables, opt_state), loss

  variables = server.generator
  (variables, _), losses = jax.lax.scan(step, (variables, optimizer.init(variables['params'])),
                                        jax.random.split(key, cfg.server_epochs))
  head = participant_average(u.values.head, weights, server.head)
  return (FedGenServer(head, variables),
          {'generator_loss': losses.mean() if cfg.server_epochs else jnp.asarray(0.0)})


def broadcast_scalars(b: FedGenServer) -> dict:
  """The head and G's parameters (FedRE Table 11 counts the heads only: HtFLlib never sends G; G's BatchNorm
  running statistics are not sent: clients run G in training mode). The label distribution is fixed at
  construction and not counted per round."""
  return {'head': b.head['kernel'].size + b.head['bias'].size,
          'generator': sum(a.size for a in jax.tree.leaves(b.generator['params']))}


def fedgen(cfg: FedGenConfig, num_classes: int, label_counts: Optional[np.ndarray] = None) -> Algorithm:
  """FedGen as an `Algorithm` (`label_counts` [C]: all clients' training label counts, whose distribution the
  generated labels follow; None: uniform). Generated batches have cfg.generator_batch_size rows, or the run's local
  batch size."""
  draws = GeneratedDraws(cfg, num_classes, label_distribution(num_classes, label_counts))
  phase = Phase('fedgen', functools.partial(client_program, draws), functools.partial(server_update, draws),
                server_of_spec=True, traffic=Traffic(broadcast=broadcast_scalars))
  return Algorithm('fedgen', functools.partial(init_server, draws), (phase,), global_head_evaluation)
