"""The batching rule as a setting: HtFLlib's drop_last epochs against PyTorch's default loader, which trains on the
last partial batch (GeFL's code). A partial batch is padded to the full shape and masked; padding must never change
a result, and a client smaller than a batch must train."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tree_allclose
from fedjax_het.core import Algorithm, Capabilities, ClientProgram, Phase, Stage
from fedjax_het.data.datasets import make_synthetic
from fedjax_het.data.federated import FederatedData
from fedjax_het.data.partition import ClientSplit
from fedjax_het.engine import ExecutionConfig, Federation, LocalTraining, ModelConfig, batch_schedule
from fedjax_het.engine.plan import stage_steps_per_epoch
from fedjax_het.errors import ConfigError
from fedjax_het.generators.base import bce, gaussian_kl
from fedjax_het.generators.cvae import cvae_loss
from fedjax_het.local_training import batch_row_mask
from fedjax_het.methods import FedREConfig, fedre, local
from fedjax_het.methods.shared.base import local_head_evaluation
from fedjax_het.methods.shared.common import cross_entropy
from fedjax_het.models.forward import forward
from fedjax_het.models.norm import TorchBatchNorm
from fedjax_het.models.registry import build_model

SIZES = (5, 20)  # client 0 holds fewer rows than one batch of 8


def sized_data(sizes=SIZES) -> FederatedData:
  ds = make_synthetic(num_samples=sum(sizes), image_shape=(8, 8, 1), num_classes=4, noise=0.3, seed=2)
  bounds = np.cumsum((0,) + tuple(sizes))
  train = [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
  counts = np.stack([np.bincount(ds.y[i], minlength=4) for i in train])
  split = ClientSplit(train, [np.arange(0)] * len(sizes), counts, np.zeros_like(counts))
  return FederatedData(ds, split, 'global')


def test_keep_last_schedule_covers_every_row_once_per_epoch():
  for order in ('stored', 'shuffle'):
    idx, valid = batch_schedule(jax.random.PRNGKey(0), jnp.asarray(21), n_max=40, batch_size=4, epochs=2,
                                order=order, drop_last=False)
    idx, valid = np.asarray(idx).reshape(2, 10, 4), np.asarray(valid).reshape(2, 10)  # ceil(40 / 4) slots
    assert valid.sum(1).tolist() == [6, 6]  # ceil(21 / 4)
    for e in range(2):
      masks = np.stack([np.asarray(batch_row_mask(s, 21, 4)) for s in range(6)])
      used = idx[e][:6][masks]
      assert sorted(used.tolist()) == list(range(21))  # every real row once, never a padding row
    if order == 'stored':
      np.testing.assert_array_equal(idx[0][:6][masks], np.arange(21))
  assert np.asarray(batch_row_mask(5, 21, 4)).tolist() == [True, False, False, False]
  # A group whose largest client is not a multiple of the batch: the last slot's indices stay inside the rows.
  idx, _ = batch_schedule(jax.random.PRNGKey(0), jnp.asarray(21), n_max=22, batch_size=4, epochs=1,
                          drop_last=False)
  assert idx.shape == (6, 4) and int(idx.max()) == 21


def test_steps_per_epoch_of_each_rule():
  """GeFL's Fig. 2/4 setting: 60 rows, batch 64. drop_last: no real step; PyTorch's loader: one step of 60 rows.
  The synthetic stage takes max(1, n // B) steps either way (GeFL's code)."""
  keep, drop = LocalTraining(batch_size=64, drop_last=False), LocalTraining(batch_size=64)
  real, generated = Stage(None, 1), Stage(None, 1, generated=True)
  assert [int(stage_steps_per_epoch(t, real, 60)) for t in (drop, keep)] == [0, 1]
  assert [int(stage_steps_per_epoch(t, generated, 60)) for t in (drop, keep)] == [1, 1]
  assert [int(stage_steps_per_epoch(t, real, 600)) for t in (drop, keep)] == [9, 10]
  assert [int(stage_steps_per_epoch(t, generated, 600)) for t in (drop, keep)] == [9, 9]
  # Statistics passes over the train loader: drop_last's stored loader visits 20 of 21 rows at batch 4.
  assert [int(LocalTraining(batch_size=4, drop_last=d).statistics_rows(jnp.asarray(21))) for d in (True, False)] \
      == [20, 21]


class TinyBN(nn.Module):
  @nn.compact
  def __call__(self, x, train=False):
    x = nn.Dense(6)(x.reshape(x.shape[0], -1))
    return nn.relu(TorchBatchNorm(use_running_average=not train)(x))


def test_masked_padded_batch_equals_the_short_batch_with_batchnorm():
  """Loss, gradients and BatchNorm statistics of a batch of 3 real rows padded to 8 (padding rows set to large
  values) equal those of the 3 rows alone."""
  from fedjax_het.models.classifier import HeteroClassifier
  model = HeteroClassifier(TinyBN(), num_classes=4, feature_dim=6)
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 4, 4, 1))
  y = jnp.array([0, 1, 3, 2, 2, 2, 2, 2])
  variables = model.init(jax.random.PRNGKey(1), x, False)
  params, state = variables['params'], {'batch_stats': variables['batch_stats']}
  mask = jnp.arange(8) < 3
  padded = jnp.where(mask[:, None, None, None], x, 50.0)

  def loss(p, xb, yb, m):
    logits, _, new = forward(model, p, state, xb, True, m)
    return cross_entropy(logits, yb, m), new
  value_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (short, s_short), g_short = value_and_grad(params, x[:3], y[:3], None)
  (long, s_long), g_long = value_and_grad(params, padded, y, mask)
  np.testing.assert_allclose(long, short, rtol=1e-5)
  tree_allclose(g_long, g_short, rtol=1e-4, atol=1e-6)
  tree_allclose(s_long, s_short, rtol=1e-5, atol=1e-6)
  # Without the mask the padding would count: the check above can fail.
  (unmasked, _), _ = value_and_grad(params, padded, y, None)
  assert abs(float(unmasked) - float(short)) > 1e-3


def test_generator_losses_count_only_real_rows():
  key = jax.random.PRNGKey(3)
  a, b, mu, logvar = (jax.random.normal(jax.random.fold_in(key, i), s)
                      for i, s in enumerate([(5, 2, 2, 1), (5, 2, 2, 1), (5, 3), (5, 3)]))
  p = jax.nn.sigmoid(jax.random.normal(key, (5, 1, 1, 1)))
  mask = jnp.array([True, True, False, True, False])
  rows = np.flatnonzero(np.asarray(mask))
  np.testing.assert_allclose(cvae_loss(a, b, mu, logvar, mask), cvae_loss(a[rows], b[rows], mu[rows], logvar[rows]),
                             rtol=1e-6)
  np.testing.assert_allclose(gaussian_kl(mu, logvar, mask), gaussian_kl(mu[rows], logvar[rows]), rtol=1e-6)
  np.testing.assert_allclose(bce(p, 1.0, mask), bce(p[rows], 1.0), rtol=1e-6)
  # By hand: BCE against 1 of p = (0.5, 0.25) is (ln 2 + ln 4) / 2.
  np.testing.assert_allclose(bce(jnp.array([0.5, 0.25, 0.9]), 1.0, jnp.array([True, True, False])),
                             (np.log(2) + np.log(4)) / 2, rtol=1e-6)


def counting_algorithm(real_epochs: int = 1) -> Algorithm:
  """A method whose clients count the rows of their generated and real batches (stage 1 and 2)."""
  def program(group):
    def count(slot):
      def step(carry, batch, broadcast, key):
        rows = batch.mask.sum() if batch.mask is not None else batch.x.shape[0]
        return (carry[0], carry[1].at[slot].add(rows)), 0.0
      return step
    return ClientProgram(lambda client, b, k: (client, jnp.zeros(2, jnp.int32)),
                         (Stage(count(0), 1, generated=True), Stage(count(1), real_epochs)),
                         lambda carry, rows, b, k: (carry[0], {'rows': carry[1]}), group.training)

  def server(state, uploads, key):
    return {'rows': jnp.concatenate([u.values['rows'] for u in uploads])}, {}
  return Algorithm('count', lambda key, spec, initial: {'rows': jnp.zeros((2, 2), jnp.int32)},
                   (Phase('count', program, server),), local_head_evaluation,
                   capabilities=Capabilities(partial_batches=True))


@pytest.mark.parametrize('strategy', ['sequential', 'vmap'])
def test_rows_each_stage_trains_on_under_each_rule(strategy):
  """Clients of 5 and 20 rows, batch 8, one epoch. Generated stage: max(1, n // 8) steps of min(n, 8) rows:
  5 and 16. Real stage: drop_last 0 and 16 rows; PyTorch's loader all 5 and 20 (8 + 8 + 4)."""
  data = sized_data()
  for drop_last, real in ((True, [0, 16]), (False, [5, 20])):
    fed = Federation(counting_algorithm(), data, ModelConfig(['mlp'], feature_dim=16),
                     LocalTraining(0.05, 8, 1, drop_last=drop_last),
                     ExecutionConfig(strategy=strategy, conv='xla', eval_batch_size=16), rounds=1)
    state, metrics = fed.round(fed.init())
    assert np.asarray(state.server['rows']).tolist() == [[5, real[0]], [16, real[1]]]
    assert metrics['local_samples'] == 5 + 16 + sum(real)


@pytest.mark.parametrize('strategy', ['sequential', 'vmap'])
def test_client_smaller_than_a_batch_takes_one_step_on_its_rows(strategy):
  """Local training, batch 8, one epoch, PyTorch's loader: the 5-row client's model after the round is one SGD
  step on its 5 rows as a batch of 5, computed here without the engine; under drop_last it does not move."""
  data = sized_data()
  model = build_model('mlp', 4, 16, 'ap', 'xla')
  for drop_last in (False, True):
    fed = Federation(local(4), data, ModelConfig(['mlp'], feature_dim=16),
                     LocalTraining(0.05, 8, 1, drop_last=drop_last),
                     ExecutionConfig(strategy=strategy, conv='xla', eval_batch_size=16), rounds=1)
    start = fed.init()
    before = jax.tree.map(lambda a: np.asarray(a[0]), start.groups[0].params)  # round() donates the state
    state, _ = fed.round(start)
    after = jax.tree.map(lambda a: a[0], state.groups[0].params)
    if drop_last:
      tree_allclose(after, before, rtol=0, atol=0)
      continue
    x, y = data.dataset.x[:5], data.dataset.y[:5]
    grads = jax.grad(lambda p: cross_entropy(forward(model, p, {}, x, True)[0], y))(before)
    expected = jax.tree.map(lambda p, g: p - 0.05 * g, before, grads)
    tree_allclose(after, expected, rtol=1e-5, atol=1e-6)


def test_a_method_without_masked_losses_refuses_partial_batches():
  with pytest.raises(ConfigError, match='LocalTraining.drop_last=False'):
    Federation(fedre(FedREConfig(), 4), sized_data(), ModelConfig(['mlp'], feature_dim=16),
               LocalTraining(0.05, 8, 1, drop_last=False), ExecutionConfig(strategy='sequential', conv='xla'),
               rounds=1)


def test_last_rounds_at_full_participation():
  """FedVTC's baselines: 105 rounds at 10 % participation, the last 5 with every client."""
  data = sized_data((8,) * 10)
  fed = Federation(local(4), data, ModelConfig(['mlp'], feature_dim=16), LocalTraining(0.05, 8, 1),
                   ExecutionConfig(strategy='sequential', conv='xla'), join_ratio=0.1, rounds=105,
                   full_participation_rounds=5)
  assert [len(fed.participants(r)) for r in (0, 99, 100, 104)] == [1, 1, 10, 10]
  with pytest.raises(ConfigError, match='Federation.full_participation_rounds'):
    Federation(local(4), data, ModelConfig(['mlp'], feature_dim=16), LocalTraining(0.05, 8, 1),
               ExecutionConfig(strategy='sequential', conv='xla'), rounds=5, full_participation_rounds=-1)


@pytest.mark.parametrize('strategy', ['sequential', 'vmap'])
def test_synthetic_only_round_trains_on_no_real_row(strategy):
  """GeFL's synthetic-only rows (Tables VII/VIII 'Syn'): --local_epochs=0 leaves only the generated stage."""
  fed = Federation(counting_algorithm(real_epochs=0), sized_data(), ModelConfig(['mlp'], feature_dim=16),
                   LocalTraining(0.05, 8, 0), ExecutionConfig(strategy=strategy, conv='xla', eval_batch_size=16),
                   rounds=1)
  state, metrics = fed.round(fed.init())
  assert np.asarray(state.server['rows']).tolist() == [[5, 0], [16, 0]]


def test_zero_local_epochs_only_for_methods_that_train_on_generated_data():
  from fedjax_het.methods import GeFLConfig
  from fedjax_het.run.config import ExperimentConfig
  from fedjax_het.run.experiment import validate
  validate(ExperimentConfig(algorithm='gefl', local_epochs=0, methods={'gefl': GeFLConfig(synthetic_epochs=5)}))
  with pytest.raises(ConfigError, match='--local_epochs=0 must be >= 1 .*--gefl_synthetic_epochs'):
    validate(ExperimentConfig(algorithm='fedavg', local_epochs=0))
