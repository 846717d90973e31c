"""A method beyond a single loss (per-client generator and discriminator with their own Adam states, several steps
per batch, two phases), written as a user would add one (this module plus, for the command line, one registry
line): a federated conditional GAN that aids heterogeneous classifiers.

Phase 'gan': every client holds a generator G and a discriminator D in its per-client state, each with an Adam
state that persists across rounds; per local batch it takes a D step, then a G step, then an SGD step of its
classifier on the real batch. The server averages G over ALL participants (every architecture group) and the
classifiers WITHIN each architecture group (model-wise FedAvg). Phase 'synthetic': the classifiers train on
batches G generates for the batch's labels; the server keeps averaging them within groups.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_het.core import Algorithm, Batch, ClientProgram, Phase, single_stage
from fedjax_het.methods.shared.base import head_evaluation, own_head
from fedjax_het.methods.shared.common import cross_entropy, train_forward

NOISE = 4


class Generator(nn.Module):
  """(noise, labels) -> images in [-1, 1] of `shape`."""
  num_classes: int
  shape: tuple

  @nn.compact
  def __call__(self, noise, labels):
    h = nn.relu(nn.Dense(32)(jnp.concatenate([noise, jax.nn.one_hot(labels, self.num_classes)], -1)))
    return jnp.tanh(nn.Dense(math.prod(self.shape))(h)).reshape((-1,) + tuple(self.shape))


class Discriminator(nn.Module):
  """(images, labels) -> real/fake logit."""
  num_classes: int

  @nn.compact
  def __call__(self, x, labels):
    h = jnp.concatenate([x.reshape(x.shape[0], -1), jax.nn.one_hot(labels, self.num_classes)], -1)
    return nn.Dense(1)(nn.relu(nn.Dense(32)(h)))[:, 0]


def receive(client, broadcast):
  """The group's classifier and the global generator."""
  return client._replace(params=broadcast['classifier'], extra={**client.extra, 'gen': broadcast['generator']})


def cgan(num_classes: int, gan_rounds: int = 2, learning_rate: float = 0.05, adam_rate: float = 1e-3) -> Algorithm:
  """The conditional-GAN method as an `Algorithm` of two phases."""
  adam = optax.adam(adam_rate)
  sgd = optax.sgd(learning_rate)

  def modules(group):
    return Generator(num_classes, group.input_shape), Discriminator(num_classes)

  def init_client(group, key):
    gen, disc = modules(group)
    g = gen.init(jax.random.fold_in(key, 7), jnp.zeros((1, NOISE)), jnp.zeros(1, jnp.int32))['params']
    d = disc.init(jax.random.fold_in(key, 8), group.sample_input(), jnp.zeros(1, jnp.int32))['params']
    return {'gen': g, 'disc': d, 'gen_opt': adam.init(g), 'disc_opt': adam.init(d)}

  def init_server(key, spec, initial):
    return {'generator': initial[0].extra['gen'], 'classifiers': tuple(s.params for s in initial)}

  def broadcast(server, group):
    return {'generator': server['generator'], 'classifier': server['classifiers'][group.index]}

  def classifier_step(group, client, opt_state, x, y):
    def loss(params):
      logits, _, updated = train_forward(group.model, client._replace(params=params), x)
      return cross_entropy(logits, y), updated
    (value, updated), grads = jax.value_and_grad(loss, has_aux=True)(client.params)
    updates, opt_state = sgd.update(grads, opt_state, client.params)
    return updated._replace(params=optax.apply_updates(client.params, updates)), opt_state, value

  def gan_client(group) -> ClientProgram:
    gen, disc = modules(group)
    bce = lambda logits, target: optax.sigmoid_binary_cross_entropy(logits, jnp.full_like(logits, target)).mean()

    def init(client, broadcast, key):
      client = receive(client, broadcast)
      return client, sgd.init(client.params)

    def step(carry, batch: Batch, broadcast, key):
      client, opt_state = carry
      e = client.extra
      noise = jax.random.normal(key, (batch.y.shape[0], NOISE))
      fake = gen.apply({'params': e['gen']}, noise, batch.y)

      def d_loss(d):  # the D step: real -> 1, fake -> 0
        return (bce(disc.apply({'params': d}, batch.x, batch.y), 1.0)
                + bce(disc.apply({'params': d}, jax.lax.stop_gradient(fake), batch.y), 0.0))
      dl, grads = jax.value_and_grad(d_loss)(e['disc'])
      updates, disc_opt = adam.update(grads, e['disc_opt'], e['disc'])
      disc_params = optax.apply_updates(e['disc'], updates)

      def g_loss(g):  # then the G step against the updated D
        return bce(disc.apply({'params': disc_params}, gen.apply({'params': g}, noise, batch.y), batch.y), 1.0)
      gl, grads = jax.value_and_grad(g_loss)(e['gen'])
      updates, gen_opt = adam.update(grads, e['gen_opt'], e['gen'])
      extra = {'gen': optax.apply_updates(e['gen'], updates), 'disc': disc_params, 'gen_opt': gen_opt,
               'disc_opt': disc_opt}
      client, opt_state, ce = classifier_step(group, client._replace(extra=extra), opt_state, batch.x, batch.y)
      return (client, opt_state), dl + gl + ce

    def final(carry, rows, broadcast, key):
      client = carry[0]
      return client, {'generator': client.extra['gen'], 'classifier': client.params}
    return ClientProgram(init, single_stage(step, group.training), final, group.training)

  def synthetic_client(group) -> ClientProgram:
    gen, _ = modules(group)

    def init(client, broadcast, key):
      client = receive(client, broadcast)
      return client, sgd.init(client.params)

    def step(carry, batch: Batch, broadcast, key):
      client, opt_state = carry
      noise = jax.random.normal(key, (batch.y.shape[0], NOISE))
      x = gen.apply({'params': client.extra['gen']}, noise, batch.y)  # a generated batch for the real labels
      client, opt_state, ce = classifier_step(group, client, opt_state, x, batch.y)
      return (client, opt_state), ce

    def final(carry, rows, broadcast, key):
      return carry[0], {'classifier': carry[0].params}
    return ClientProgram(init, single_stage(step, group.training), final, group.training)

  def average_classifiers(server, uploads):
    return uploads.group_mean('classifier', by='rows', previous=server['classifiers'])

  def gan_server(server, uploads, key):
    generator = uploads.mean('generator', previous=server['generator'])
    return {'generator': generator, 'classifiers': average_classifiers(server, uploads)}, {}

  def synthetic_server(server, uploads, key):
    return {**server, 'classifiers': average_classifiers(server, uploads)}, {}

  evaluation = lambda group: head_evaluation(group.model, {'group_model': own_head}, receive=receive)
  return Algorithm('cgan', init_server,
                   (Phase('gan', gan_client, gan_server, broadcast, rounds=gan_rounds),
                    Phase('synthetic', synthetic_client, synthetic_server, broadcast)),
                   evaluation, init_client=init_client)
