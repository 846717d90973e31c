"""GeFL ("GeFL: Model-Agnostic Federated Learning with Generative Models"): the servers' means (the generator over all
groups, each target model within its group), per-client optimizer states across rounds, the round structure of both
modes, Table X's communication and resume across the knowledge -> target boundary, on a tiny DCGAN (vmap == sequential:
the golden run's vmap case in tests/test_golden.py, in the slow set)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import tree_allclose
from runs import record_rounds, run_rounds
from fedjax_het.core import Uploads, leaf_scalars
from fedjax_het.errors import ConfigError
from fedjax_het.methods import GeFLConfig, gefl
from fedjax_het.methods.fedprox import proximal_term
from fedjax_het.methods.gefl import GeFLBroadcast, GeFLServer, GeFLUpload, TargetModel, build_generator
from fedjax_het.run.checkpoints import Checkpoints
from fedjax_het.run.config import ExperimentConfig
from fedjax_het.run.experiment import build_federation
from fedjax_het.uploads import RoundUploads

GEFL = GeFLConfig(generator='dcgan', ka_rounds=2, generator_epochs=1, width=4)
# One architecture group and a quarter of the synthetic rows (one or two batches per client) keep compilation and
# execution small; the servers' cross-group and within-group means are tested directly above the runs.
CFG = ExperimentConfig(algorithm='gefl', dataset='synthetic:32,32,1', data_fraction=0.25, num_clients=4,
                       partition='iid', models=('gefl_mnist_cnn1',), feature_dim=16, rm='fc', rounds=2, batch_size=64,
                       local_learning_rate=0.05, eval_protocol='global', data_order='shuffle', conv='xla',
                       checkpoint_every=1, methods={'gefl': GEFL})


def uploads(values, mask, num_train=None):
  mask = jnp.asarray(mask)
  return Uploads(values, mask, jnp.asarray(num_train if num_train is not None else np.ones(len(mask)), jnp.float32))


# ------------------------------------------------------------------ the servers
def test_knowledge_server_averages_the_generator_over_all_participants_of_all_groups_unweighted():
  alg = gefl(GEFL, 10, 2)
  server = GeFLServer({'w': jnp.full(2, -7.0)}, jnp.asarray(0), ({}, {}))
  group0 = uploads(GeFLUpload(generator={'w': jnp.asarray([[1.0, 2.0], [3.0, 4.0], [0.0, 0.0]])}), [1, 1, 0],
                   [10, 90, 0])
  group1 = uploads(GeFLUpload(generator={'w': jnp.asarray([[5.0, 6.0]])}), [1], [1000])
  new, _ = alg.phases[0].server_update(server, RoundUploads((group0, group1)), jax.random.PRNGKey(0))
  np.testing.assert_allclose(new.generator['w'], [3.0, 4.0])  # (1 + 3 + 5) / 3, sample sizes ignored
  assert int(new.generator_round) == 1
  nobody = uploads(GeFLUpload(generator={'w': jnp.ones((1, 2))}), [0])
  kept, _ = alg.phases[0].server_update(server, RoundUploads((nobody, nobody)), jax.random.PRNGKey(0))
  np.testing.assert_allclose(kept.generator['w'], [-7.0, -7.0])


def test_target_server_averages_each_group_within_itself_with_equal_weights():
  alg = gefl(GEFL, 10, 2)
  model = lambda v: TargetModel({'w': jnp.asarray(v, jnp.float32)}, {'s': jnp.asarray(v, jnp.float32)})
  server = GeFLServer({'w': jnp.zeros(1)}, jnp.asarray(2), (model([0.0]), model([9.0])))
  stack = lambda *ms: jax.tree.map(lambda *a: jnp.stack(a), *ms)
  group0 = uploads(GeFLUpload(stack(model([1.0]), model([5.0]))), [1, 1], [10, 1000])
  group1 = uploads(GeFLUpload(stack(model([100.0]))), [0])
  new, _ = alg.phases[1].server_update(server, RoundUploads((group0, group1)), jax.random.PRNGKey(0))
  np.testing.assert_allclose(new.models[0].params['w'], [3.0])      # BN statistics averaged too
  np.testing.assert_allclose(new.models[0].model_state['s'], [3.0])
  np.testing.assert_allclose(new.models[1].params['w'], [9.0])      # nobody in group 1: kept
  assert int(new.generator_round) == 2                               # freeze: the generator stays


def test_update_mode_target_server_averages_models_within_and_the_generator_across_architectures():
  """Update mode with two architectures whose models differ in shape: each model within its group, the generator
  over every participant of every group."""
  alg = gefl(dataclasses.replace(GEFL, mode='update'), 10, 2)
  stack = lambda *ts: jax.tree.map(lambda *a: jnp.stack(a), *ts)
  small = lambda v: TargetModel({'w': jnp.full(1, v)}, {})
  large = lambda v: TargetModel({'w': jnp.full(1, v), 'extra': jnp.full(3, v)}, {})
  gen = lambda v: {'w': jnp.full(2, v)}
  server = GeFLServer(gen(0.0), jnp.asarray(1), (small(0.0), large(0.0)))
  group0 = uploads(GeFLUpload(stack(small(1.0), small(3.0)), stack(gen(1.0), gen(3.0))), [1, 1])
  group1 = uploads(GeFLUpload(stack(large(8.0)), stack(gen(8.0))), [1])
  new, _ = alg.phases[1].server_update(server, RoundUploads((group0, group1)), jax.random.PRNGKey(0))
  np.testing.assert_allclose(new.models[0].params['w'], [2.0])
  np.testing.assert_allclose(new.models[1].params['extra'], [8.0, 8.0, 8.0])
  np.testing.assert_allclose(new.generator['w'], [4.0, 4.0])  # (1 + 3 + 8) / 3
  assert int(new.generator_round) == 2


# ------------------------------------------------------------------ the run
# The recorded four-round run and the checks on it are in the slow set (`-m slow`, about 17 s of a 2-core CPU): the
# default run pins GeFL's numbers through its golden run (tests/test_golden.py) and resumes across a phase boundary
# in tests/test_fedvtc.py, tests/test_felo.py and tests/test_phases.py.
@pytest.fixture(scope='module')
def fed():
  return build_federation(CFG)


@pytest.fixture(scope='module')
def recorded(fed):
  return record_rounds(fed, fed.init(), fed.total_rounds)


@pytest.mark.slow
def test_the_run_is_knowledge_then_target_rounds_with_their_steps_and_traffic(fed, recorded):
  h = recorded.history
  assert fed.total_rounds == 4 and [m['phase'] for m in h] == ['knowledge'] * 2 + ['target'] * 2
  assert [m['round'] for m in h] == [1, 2, 3, 4]
  assert not fed.evaluates_after(1, 1) and fed.evaluates_after(2, 1)  # knowledge rounds are not evaluated
  steps = fed.train_sizes // 64
  assert h[0]['local_steps'] == steps.sum()                                 # T_g = 1 epoch of real batches
  assert h[2]['local_steps'] == np.maximum(1, steps).sum() + steps.sum()    # T_s = 1 generated + T_r = 1 real
  generator = sum(leaf_scalars(fed.init().server.generator).values())
  assert h[0]['upload_generator_scalars'] == h[0]['broadcast_generator_scalars'] == 4 * generator
  assert 'upload_generator_scalars' not in h[2] and 'broadcast_generator_scalars' not in h[2]
  assert h[2]['upload_model_scalars'] == h[2]['broadcast_model_scalars'] > 0
  assert all(np.isfinite(m['train_loss']) for m in h)


@pytest.mark.slow
def test_each_client_keeps_its_own_optimizer_state_across_the_broadcast(fed, recorded):
  """After round 1 the clients' Adam states differ (own data) while their generators are replaced by the mean at
  the next round's start; after round 2 each Adam step counter holds both rounds' steps."""
  steps = fed.train_sizes // 64
  first, second = recorded.states[0], recorded.states[1]
  counts = lambda st: np.concatenate([np.asarray(g.extra.optimizer['G'].count) for g in st.groups])
  order = np.concatenate([g.clients for g in fed.groups])
  np.testing.assert_array_equal(counts(first), steps[order])
  np.testing.assert_array_equal(counts(second), 2 * steps[order])
  mu = np.asarray(jax.tree.leaves(optax.tree_utils.tree_get(first.groups[0].extra.optimizer['D'], 'mu'))[0])
  assert not np.allclose(mu[0], mu[1])
  server_gen = jax.tree.leaves(second.server.generator)[0]
  assert np.isfinite(np.asarray(server_gen)).all()


@pytest.mark.slow
def test_resume_across_the_knowledge_to_target_boundary_equals_the_uninterrupted_run(fed, recorded, tmp_path):
  checkpoints = Checkpoints(str(tmp_path / 'ckpt'))
  checkpoints.save(recorded.states[1])  # the end of the knowledge phase
  restored = checkpoints.restore(fed.init(), 2)
  state, rest = run_rounds(fed, restored, 2)
  tree_allclose(state.groups, recorded.states[-1].groups, rtol=0, atol=0)
  assert recorded.history[2:] == rest


@pytest.mark.slow
def test_update_mode_runs_half_the_knowledge_rounds_and_keeps_training_the_generator():
  """Update mode: T_KA / 2 knowledge rounds, then every target round trains and averages the generator too, so
  target round t samples from the generator after T_KA / 2 + t - 1 rounds."""
  cfg = dataclasses.replace(CFG, rounds=1, methods={'gefl': dataclasses.replace(GEFL, ka_rounds=2, mode='update')})
  fed = build_federation(cfg)
  rec = record_rounds(fed, fed.init(), fed.total_rounds)
  assert [m['phase'] for m in rec.history] == ['knowledge', 'target']
  assert [int(s.server.generator_round) for s in rec.states] == [1, 2]
  assert rec.history[1]['upload_generator_scalars'] == rec.history[1]['broadcast_generator_scalars'] > 0
  steps = fed.train_sizes // 64
  assert rec.history[1]['local_steps'] == np.maximum(1, steps).sum() + 2 * steps.sum()  # T_s + T_r + T_g
  assert not np.allclose(jax.tree.leaves(rec.states[1].server.generator)[0],
                         jax.tree.leaves(rec.states[0].server.generator)[0])


# ------------------------------------------------------------------ accounting, inputs, outputs
@pytest.mark.parametrize('generator, channels, rounds, gib', [('dcgan', 1, 100, 2.13), ('cvae', 1, 100, 8.32),
                                                              ('ddpm', 1, 100, 2.82), ('dcgan', 3, 200, 8.99)])
def test_table_x_cumulative_generator_download_per_client(generator, channels, rounds, gib):
  """GeFL paper, Table X: T_KA x (|G| + |D|) x 4 bytes / 2^30 downloaded by each client over knowledge aggregation
  (paper sizes; parameters only: the BatchNorm statistics that also cross add < 0.1 %)."""
  gen = build_generator(GeFLConfig(generator=generator), 10, (32, 32, channels))
  variables = jax.eval_shape(gen.init, jax.random.PRNGKey(0))
  params = [v['params'] for v in variables.values()] if generator == 'dcgan' else variables['params']
  count = sum(math.prod(a.shape) for a in jax.tree.leaves(params))
  assert rounds * count * 4 / 2 ** 30 == pytest.approx(gib, abs=0.01)  # CVAE 8.328 printed as 8.32


def test_generators_need_32x32_images_and_the_fix_is_named():
  with pytest.raises(ConfigError, match=r'Fix: Dataset\.resized\(32\)'):
    build_generator(GEFL, 10, (28, 28, 1))
  with pytest.raises(ConfigError, match="^GeFLConfig.generator='gan'"):
    GeFLConfig(generator='gan')


def test_fedprox_proximal_term_squared_and_the_codes_norm_form():
  w, anchor = {'a': jnp.asarray([3.0, 4.0]), 'b': jnp.asarray([1.0])}, {'a': jnp.zeros(2), 'b': jnp.zeros(1)}
  assert float(proximal_term(w, anchor)) == pytest.approx(26.0)        # 9 + 16 + 1
  assert float(proximal_term(w, anchor, 'norm')) == pytest.approx(6.0)  # ||(3, 4)|| + ||1||


def test_gefls_reported_number_is_the_mean_over_architectures_of_each_ones_best_round():
  from fedjax_het.run.experiment import best_per_architecture_mean
  cfg = dataclasses.replace(CFG, models=('mlp', 'gefl_mnist_cnn1'))  # clients 0, 2: mlp; 1, 3: cnn1
  evals = [{'client_accuracy': [0.5, 0.1, 0.7, 0.1]}, {'client_accuracy': [0.2, 0.9, 0.2, 0.7]}]
  # mlp: best of (0.6, 0.2) = 0.6; cnn1: best of (0.1, 0.8) = 0.8 -> 0.7 (the best single round has 0.6 or 0.5)
  assert best_per_architecture_mean(cfg, evals) == pytest.approx(0.7)
  assert best_per_architecture_mean(cfg, [{'accuracy': 0.3}]) is None


def test_shared_first_block_is_the_unweighted_mean_over_all_participants():
  """--gefl_share_first_block (the code's avg_FE = 1): F's parameters and BatchNorm statistics averaged over every
  participant of every architecture; the rest of each model stays its group's average."""
  from fedjax_het.methods.gefl import with_shared_first_block
  from fedjax_het.core import Uploads

  def model(fe, rest):
    return TargetModel({'extractor': {'fe_conv': {'kernel': fe}, 'conv0': {'kernel': rest}}, 'head': {'bias': rest}},
                       {'batch_stats': {'extractor': {'fe_bn': {'mean': 10 * fe}}}})
  arr = lambda *v: jnp.asarray(v, jnp.float32)
  uploads = RoundUploads((Uploads(GeFLUpload(model(arr(1., 3.), arr(0., 0.))), jnp.array([True, True]), arr(1., 1.)),
                          Uploads(GeFLUpload(model(arr(5., 7.), arr(0., 0.))), jnp.array([True, False]),
                                  arr(1., 1.))))
  group_means = (model(jnp.float32(2.), jnp.float32(-1.)), model(jnp.float32(5.), jnp.float32(-2.)))
  out = with_shared_first_block(group_means, uploads)
  for g, rest in zip(out, (-1., -2.)):
    np.testing.assert_allclose(g.params['extractor']['fe_conv']['kernel'], 3.0)  # (1 + 3 + 5) / 3
    np.testing.assert_allclose(g.model_state['batch_stats']['extractor']['fe_bn']['mean'], 30.0)
    np.testing.assert_allclose(g.params['extractor']['conv0']['kernel'], rest)
    np.testing.assert_allclose(g.params['head']['bias'], rest)


def test_synthetic_batches_have_uniform_labels_and_the_classifiers_range():
  """Labels uniform over all classes; a [0, 1] generator's samples (CVAE, DDPM) mapped to [-1, 1] with
  --gefl_match_range, left in [0, 1] without (the code's mismatch); DCGAN's [-1, 1] never remapped."""
  from fedjax_het.methods.gefl import synthetic_batch
  from fedjax_het.generators.base import ConditionalGenerator
  constant = lambda value, unit: ConditionalGenerator('c', None, None, None,
                                                      lambda v, y, k: jnp.full((y.shape[0], 2, 2, 1), value), unit)
  images, labels = synthetic_batch(constant(0.75, True), None, jax.random.PRNGKey(0), 20000, 10, True)
  counts = np.bincount(np.asarray(labels), minlength=10)
  assert counts.min() > 1800 and counts.max() < 2200  # 2000 each, +- 4.7 SD
  np.testing.assert_allclose(images, 0.5)  # 2 * 0.75 - 1
  np.testing.assert_allclose(synthetic_batch(constant(0.75, True), None, jax.random.PRNGKey(0), 8, 10, False)[0],
                             0.75)
  np.testing.assert_allclose(synthetic_batch(constant(-0.5, False), None, jax.random.PRNGKey(0), 8, 10, True)[0],
                             -0.5)


def test_ddpm_rate_decays_linearly_over_the_knowledge_rounds():
  """The code: lr = 1e-4 (1 - t / T_KA) in the t-th (1-based) generator round; other generators keep their rate."""
  from fedjax_het.methods.gefl import ddpm_lr_scale
  scale = ddpm_lr_scale(GeFLConfig(generator='ddpm', ka_rounds=4))
  at = lambda r: GeFLBroadcast({}, jnp.int32(r))
  np.testing.assert_allclose([float(scale(at(r))) for r in range(4)], [0.75, 0.5, 0.25, 0.0])
  assert ddpm_lr_scale(GeFLConfig(generator='cvae', ka_rounds=4))(at(0)) == 1.0
