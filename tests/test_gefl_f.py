"""GeFL-F ("GeFL: Model-Agnostic Federated Learning with Generative Models", Alg. 3): the extractor / header split of
GeFL's CNNs, and a three-phase run in which F is averaged over all groups in warm-up and then frozen, the generator
learns F's maps, and target rounds move only the headers, averaged within their group (and, in update mode, keep
training the generator). The golden run (tests/golden.py) covers freeze mode."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tree_allclose
from runs import record_rounds
from fedjax_het.errors import ConfigError
from fedjax_het.methods import GeFLFConfig
from fedjax_het.methods.gefl_f import join_client, split_client
from fedjax_het.models.init import init_variables
from fedjax_het.models.registry import build_model
from fedjax_het.run.config import ExperimentConfig
from fedjax_het.run.experiment import build_federation
from fedjax_het.uploads import RoundUploads

CFG = ExperimentConfig(algorithm='gefl_f', dataset='synthetic:32,32,1', data_fraction=0.5, num_clients=4,
                       partition='iid', models=('gefl_fmnist_cnn1', 'gefl_fmnist_cnn2'), feature_dim=16, rm='fc',
                       rounds=1, batch_size=64, local_learning_rate=0.05, eval_protocol='global', data_order='shuffle',
                       conv='xla', checkpoint_every=0,
                       methods={'gefl_f': GeFLFConfig(generator='cvae', fe_rounds=1, ka_rounds=2, generator_epochs=1,
                                                      warmup_epochs=1, width=4, latent=3, mode='update')})


def test_split_and_join_of_a_gefl_cnn_and_the_header_from_feature_maps():
  model = build_model('gefl_fmnist_cnn2', 10, 16, 'fc')
  variables = jax.jit(lambda k: init_variables(model, k, jnp.zeros((1, 32, 32, 1))))(jax.random.PRNGKey(0))
  params, state = variables.pop('params'), variables
  fe, header = split_client(params, state)
  assert set(fe['params']) == {'fe_conv', 'fe_bn'} and set(fe['stats']) == {'fe_bn'}
  assert 'fe_conv' not in header['params']['extractor'] and 'head' in header['params']
  tree_allclose(join_client(fe, header, state), (params, state), rtol=0, atol=0)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 32, 32, 1))
  features = model.extractor.clone(stage='features', parent=None)
  maps = jax.jit(features.apply)({'params': params['extractor'], 'batch_stats': state['batch_stats']['extractor']}, x)
  assert maps.shape == (2, 16, 16, 3)
  header_model = model.clone(extractor=model.extractor.clone(stage='header', parent=None), parent=None)
  tree_allclose(jax.jit(header_model.apply)({'params': params, **state}, maps),
                jax.jit(model.apply)({'params': params, **state}, x), rtol=1e-5, atol=1e-6)


# The recorded three-phase run and the checks on it are in the slow set (`-m slow`, about 34 s of a 2-core CPU):
# the default run pins GeFL-F's numbers through its golden run (tests/test_golden.py) and resumes across a phase
# boundary in tests/test_fedvtc.py, tests/test_felo.py and tests/test_phases.py.
@pytest.fixture(scope='module')
def recorded():
  fed = build_federation(CFG)
  return fed, record_rounds(fed, fed.init(), fed.total_rounds)


@pytest.mark.slow
def test_warmup_shares_f_over_all_groups_then_only_headers_and_the_generator_move(recorded):
  fed, rec = recorded
  assert [m['phase'] for m in rec.history] == ['warmup', 'knowledge', 'target']
  fe = lambda state, gi: split_client(state.groups[gi].params, state.groups[gi].model_state)[0]
  server_fe = rec.states[0].server.fe
  # After warm-up, the server's F is the mean of all four clients' F, whatever their architecture.
  stacked = jax.tree.map(lambda *a: jnp.concatenate(a), *[fe(rec.states[0], gi) for gi in range(2)])
  tree_allclose(server_fe, jax.tree.map(lambda a: a.mean(0), stacked), rtol=1e-5, atol=1e-6)
  # Knowledge rounds (T_KA / 2 = 1 in update mode) leave every classifier as it was; they train and average the
  # generator.
  tree_allclose(rec.states[1].groups[0].params, rec.states[0].groups[0].params, rtol=0, atol=0)
  assert int(rec.states[1].server.generator_round) == 1
  # Target rounds: every client's F is the shared one, unchanged; headers are averaged within each group only.
  for gi in range(2):
    for k in range(2):
      tree_allclose(jax.tree.map(lambda a: a[k], fe(rec.states[2], gi)), server_fe, rtol=0, atol=0)
  tree_allclose(rec.states[2].server.fe, server_fe, rtol=0, atol=0)
  header = lambda state, gi: split_client(state.groups[gi].params, state.groups[gi].model_state)[1]
  for gi in range(2):  # each group's header: the mean of its own two clients' trained headers
    tree_allclose(rec.states[2].server.headers[gi], jax.tree.map(lambda a: a.mean(0), header(rec.states[2], gi)),
                  rtol=1e-5, atol=1e-6)
    assert not np.allclose(*[jax.tree.leaves(header(rec.states[2], gi))[-1][k] for k in range(2)])  # they differ
  assert rec.history[2]['upload_header_scalars'] > 0 and 'upload_extractor_scalars' not in rec.history[2]
  assert rec.history[0]['upload_extractor_scalars'] == 4 * 42  # conv 3x3x1x3 + 3, BatchNorm 3 + 3 and 6 stats
  assert all(np.isfinite(m['train_loss']) for m in rec.history)
  # Update mode: the target round trains the generator T_g epochs after the headers' T_s + T_r, on F's maps, and
  # the server averages it over all four clients of both groups.
  generator = lambda state: state.server.generator
  assert int(rec.states[2].server.generator_round) == 2
  stacked = jax.tree.map(lambda *a: jnp.concatenate(a), *[g.extra.generator for g in rec.states[2].groups])
  tree_allclose(generator(rec.states[2]), jax.tree.map(lambda a: a.mean(0), stacked), rtol=1e-5, atol=1e-6)
  assert not np.allclose(jax.tree.leaves(generator(rec.states[2]))[0], jax.tree.leaves(generator(rec.states[1]))[0])
  size = sum(a.size for a in jax.tree.leaves(generator(rec.states[2])))
  assert rec.history[2]['upload_generator_scalars'] == rec.history[2]['broadcast_generator_scalars'] == 4 * size
  steps = fed.train_sizes // 64
  assert rec.history[2]['local_steps'] == np.maximum(1, steps).sum() + 2 * steps.sum()  # T_s + T_r + T_g


def test_gefl_f_refuses_models_without_its_3_channel_extractor_with_the_fix_named():
  with pytest.raises(ConfigError, match='--models=gefl-mnist-10'):  # the command line's names
    build_federation(dataclasses.replace(CFG, models=('mlp',)))
  cifar = dataclasses.replace(CFG, dataset='synthetic:32,32,3')
  with pytest.raises(ConfigError, match='gefl-cifar10f-10'):  # Table XXIII's CNNs: F would emit 10 channels
    build_federation(dataclasses.replace(cifar, models=('gefl_cifar10_cnn1',)))


def test_cifar10_cnns_as_the_code_builds_them_give_f_3x16x16_maps_and_table_xxiii_widths():
  """gefl-cifar10f-10: Table XXIII's CNNs without its conv(10) row (GeFL's code); F emits 3x16x16 maps, the
  flattened features keep the table's fc widths, and the feature generators take Table XV's CIFAR-10 sizes."""
  from fedjax_het.methods.gefl_f import feature_generator
  from fedjax_het.models.registry import MODEL_FAMILIES
  assert len(MODEL_FAMILIES['gefl-cifar10f-10']) == 10
  x = jnp.zeros((2, 32, 32, 3))
  for k, fc in ((1, 1024), (4, 320), (10, 80)):
    table, code = (build_model(f'gefl_{d}_cnn{k}', 10, 16, 'fc').extractor for d in ('cifar10', 'cifar10f'))
    params = jax.eval_shape(lambda: code.init(jax.random.PRNGKey(0), x))['params']
    assert 'fe_conv2' not in params and 'fe_conv2' in jax.eval_shape(lambda: table.init(jax.random.PRNGKey(0), x))[
        'params']
    assert jax.eval_shape(lambda: code.init_with_output(jax.random.PRNGKey(0), x)[0]).shape == (2, fc)
  latent = {}
  for d in ('cifar10f', 'mnist'):
    cfg = dataclasses.replace(CFG, dataset=f'synthetic:32,32,{3 if d == "cifar10f" else 1}', num_clients=1,
                              models=(f'gefl_{d}_cnn1',), methods={'gefl_f': GeFLFConfig(generator='cvae')})
    gen = feature_generator(cfg.method_config, 10, build_federation(cfg).spec.groups[0])
    latent[d] = jax.eval_shape(gen.init, jax.random.PRNGKey(0))['params']['encoder']['mu']['kernel'].shape[-1]
  assert latent == {'cifar10f': 50, 'mnist': 16}  # Table XV: CVAE-F's l


# After warm-up; after knowledge aggregation.
@pytest.mark.slow
@pytest.mark.parametrize('boundary', [1, 2])
def test_resume_across_each_phase_boundary_equals_the_uninterrupted_run(recorded, boundary, tmp_path):
  from fedjax_het.run.checkpoints import Checkpoints
  from runs import run_rounds
  fed, rec = recorded
  checkpoints = Checkpoints(str(tmp_path / 'ckpt'))
  checkpoints.save(rec.states[boundary - 1])
  state, rest = run_rounds(fed, checkpoints.restore(fed.init(), boundary), fed.total_rounds - boundary)
  tree_allclose(state.groups, rec.states[-1].groups, rtol=0, atol=0)
  assert rec.history[boundary:] == rest


def test_lg_fedavg_as_gefl_runs_it_averages_f_over_all_groups_and_the_rest_within_each():
  from fedjax_het.methods.gefl_f import GeFLFUpload, SharedBlock, lg_fedavg_first_block
  from fedjax_het.core import Uploads
  alg = lg_fedavg_first_block(10)
  part = lambda v: {'params': {'w': jnp.asarray(v, jnp.float32)}, 'stats': {}}
  stack = lambda *ps: jax.tree.map(lambda *a: jnp.stack(a), *ps)
  server = SharedBlock(part([0.0]), (part([0.0, 0.0]), part([-1.0])))
  group0 = Uploads(GeFLFUpload(stack(part([1.0]), part([3.0])), stack(part([1.0, 2.0]), part([3.0, 4.0]))),
                   jnp.asarray([True, True]), jnp.asarray([10.0, 90.0]))
  group1 = Uploads(GeFLFUpload(stack(part([8.0])), stack(part([5.0]))), jnp.asarray([True]), jnp.asarray([1.0]))
  new, _ = alg.phases[0].server_update(server, RoundUploads((group0, group1)), jax.random.PRNGKey(0))
  np.testing.assert_allclose(new.fe['params']['w'], [4.0])              # (1 + 3 + 8) / 3 over all groups
  np.testing.assert_allclose(new.headers[0]['params']['w'], [2.0, 3.0])  # within group 0
  np.testing.assert_allclose(new.headers[1]['params']['w'], [5.0])
  assert alg.phases[0].rounds is None
  with pytest.raises(ConfigError, match='--models=gefl-mnist-10'):
    build_federation(dataclasses.replace(CFG, algorithm='lg_fedavg_fb', models=('mlp',), methods={}))


@pytest.mark.slow
def test_mnd_samples_of_gefl_f_are_images_inverted_from_generated_maps_through_f(recorded):
  """GeFL-F's S for the MND ratio: generated feature maps inverted into images through the frozen F; the
  inversion brings F(image) towards the map it came from (relative error below that of the starting noise)."""
  from fedjax_het.evaluation.mnd import gefl_f_synthetic_images
  from fedjax_het.methods.gefl_f import apply_features, features_module
  from fedjax_het.evaluation import InversionConfig
  fed, rec = recorded
  group, server = fed.spec.groups[0], rec.states[-1].server
  key = jax.random.PRNGKey(3)
  images = gefl_f_synthetic_images(CFG.method_config, 10, group, server, key, 1,
                                 InversionConfig(steps=40, learning_rate=0.05, prior='pixel'))
  assert images.shape == (10, 32, 32, 1) and float(jnp.abs(images).max()) <= 1.0
  from fedjax_het.methods.gefl_f import feature_generator
  maps = feature_generator(CFG.method_config, 10, group).sample(server.generator, jnp.arange(10),
                                                                jax.random.split(key)[0])
  f = lambda x: apply_features(features_module(group), server.fe, x)
  error = lambda x: float(jnp.mean(jnp.sum((f(x) - maps) ** 2, (1, 2, 3)) / jnp.sum(maps ** 2, (1, 2, 3))))
  noise = 0.1 * jax.random.normal(jax.random.PRNGKey(0), images.shape)
  assert error(images) < 0.5 * error(jnp.tanh(noise))
