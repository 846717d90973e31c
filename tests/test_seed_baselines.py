"""The seed tables' baselines FedMD, FedDF, AvgKD and FedALA: the server's public dataset, their losses, targets and
aggregation rules against hand-computed values, the stages over public rows, and FedMD resumed across its phase
boundary. (vmap == sequential and the pinned numbers of all four: tests/test_golden.py.)"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_het.core import Uploads, server_step
from fedjax_het.data import Dataset, make_federated_data, make_synthetic
from fedjax_het.engine import Federation, LocalTraining, ModelConfig
from fedjax_het.errors import ConfigError
from fedjax_het.methods import FedDFConfig, FedMDConfig, fedmd
from fedjax_het.methods.avgkd import GroupState, GroupStates, soft_target
from fedjax_het.methods.feddf import distillation_loss, ensemble_logits, feddf
from fedjax_het.methods.fedmd import digest_loss
from fedjax_het.methods.shared.public import mean_of_uploads, public_logits
from fedjax_het.run.checkpoints import Checkpoints
from fedjax_het.run.config import ExperimentConfig
from fedjax_het.run.experiment import build_federation
from fedjax_het.uploads import RoundUploads
from conftest import tree_allclose
from runs import run_rounds


def test_public_rows_are_held_out_of_every_client():
  ids = np.arange(250)  # each image holds its row's id
  ds = Dataset('ids', ids.reshape(250, 1, 1, 1) * np.ones((1, 2, 2, 1), np.float32), ids % 4, 4)
  data = make_federated_data(ds, num_clients=5, partition='iid', seed=1, public_size=30)
  public = set(data.public.x[:, 0, 0, 0].astype(int).tolist())
  clients = [set(data.dataset.x[np.concatenate([tr, te]), 0, 0, 0].astype(int).tolist())
             for tr, te in zip(data.split.train_indices, data.split.test_indices)]
  assert len(public) == 30 and 'held out of ids' in data.public.source
  assert all(not (c & public) for c in clients)
  assert sum(len(c) for c in clients) == 250 - 30
  np.testing.assert_array_equal(data.public.y, data.public.x[:, 0, 0, 0].astype(int) % 4)  # labels kept with rows
  with pytest.raises(ConfigError, match='public_size=250'):
    make_federated_data(ds, num_clients=5, partition='iid', seed=1, public_size=250)


def test_another_dataset_is_matched_to_the_clients_images():
  rgb = Dataset('rgb', np.array([[[[0.3, -0.6, 0.9]]]], np.float32).repeat(2, 1).repeat(2, 2), np.zeros(1, int), 2)
  gray = rgb.matching((2, 2, 1))
  np.testing.assert_allclose(gray.x, np.full((1, 2, 2, 1), 0.2), atol=1e-7)   # (0.3 - 0.6 + 0.9) / 3
  np.testing.assert_allclose(gray.matching((4, 4, 3)).x, np.full((1, 4, 4, 3), 0.2), atol=1e-6)
  two = Dataset('two', np.zeros((1, 2, 2, 2), np.float32), np.zeros(1, int), 2)
  with pytest.raises(ConfigError, match='--public_dataset=two: its images have 2 channels'):
    two.matching((2, 2, 1))


def test_a_method_on_public_data_without_any_names_the_flags():
  cfg = ExperimentConfig(algorithm='fedmd', dataset='synthetic:8,8,1', num_clients=4, models=('mlp',),
                         feature_dim=16, rounds=2, batch_size=16)
  with pytest.raises(ConfigError, match='--public_size=N .* or --public_dataset=NAME'):
    build_federation(cfg)


def test_fedmd_digest_losses_by_hand():
  logits, consensus = jnp.array([[1.0, 2.0], [3.0, 0.0]]), jnp.array([[0.0, 2.0], [1.0, 1.0]])
  assert float(digest_loss(logits, jnp.array([0, 1]), consensus, 'mae', 0.5)) == pytest.approx(1.0)  # (1+0+2+1)/4
  # zero logits and consensus: log_softmax = -ln 2, softmax = 1/2, CE = ln 2
  felo = digest_loss(jnp.zeros((2, 2)), jnp.array([0, 1]), jnp.zeros((2, 2)), 'felo', 0.5)
  assert float(felo) == pytest.approx(math.log(2) + 0.5 * (math.log(2) + 0.5) ** 2, rel=1e-6)


def test_the_consensus_is_the_unweighted_mean_over_the_participants_of_every_group():
  a = Uploads({'logits': jnp.array([[[1.0, 2.0]], [[9.0, 9.0]]])}, jnp.array([True, False]), jnp.array([5.0, 1.0]))
  b = Uploads({'logits': jnp.array([[[3.0, 0.0]]])}, jnp.array([True]), jnp.array([100.0]))
  np.testing.assert_allclose(mean_of_uploads(RoundUploads((a, b)), 'logits'), [[2.0, 1.0]])


def test_public_logits_in_passes_equal_one_pass(tiny_data):
  fed = Federation(fedmd(FedMDConfig(), 4, make_federated_data(
      make_synthetic(num_samples=120, image_shape=(8, 8, 1), num_classes=4, seed=1), 2, 'iid', 0,
      public_size=7).public), tiny_data, ModelConfig(('small_cnn_narrow',), 16), LocalTraining(0.05, 8))
  client = jax.tree.map(lambda a: a[0], fed.init().groups[0])
  x = jax.random.normal(jax.random.PRNGKey(0), (7, 8, 8, 1))
  whole = public_logits(fed.groups[0].model, client.params, client.model_state, x, chunk=7)
  np.testing.assert_allclose(public_logits(fed.groups[0].model, client.params, client.model_state, x, chunk=3),
                             whole, rtol=1e-5, atol=1e-6)
  assert whole.shape == (7, 4)


def test_avgkd_soft_targets_by_hand():
  peers = jnp.array([[[0.2, 0.8]], [[0.6, 0.4]]])  # two other models, one row
  np.testing.assert_allclose(soft_target(jnp.array([0]), peers, 2, 'average'), [[0.6, 0.4]], rtol=1e-6)
  e = math.exp(0.6)  # softmax([1.8, 1.2])
  np.testing.assert_allclose(soft_target(jnp.array([0]), peers, 2, 'gefl'), [[e / (e + 1), 1 / (e + 1)]], rtol=1e-6)
  np.testing.assert_allclose(soft_target(jnp.array([1]), jnp.zeros((0, 1, 2)), 2, 'average'), [[0.0, 1.0]])


def test_feddf_distillation_loss_by_hand():
  teacher, student = jnp.array([[0.0, math.log(3)]] * 2), jnp.zeros((2, 2))  # q = (1/4, 3/4), p = (1/2, 1/2)
  kl = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
  assert float(distillation_loss(student, teacher, 1.0)) == pytest.approx(kl, rel=1e-6)
  q = 1 / (1 + math.sqrt(3))  # T = 2: softmax([0, ln(3) / 2])
  assert float(distillation_loss(student, teacher, 2.0)) == pytest.approx(
      q * math.log(2 * q) + (1 - q) * math.log(2 * (1 - q)), rel=1e-6)


@pytest.fixture(scope='module')
def feddf_federation(tiny_data):
  data = make_federated_data(make_synthetic(num_samples=480, image_shape=(8, 8, 1), num_classes=4, noise=0.3,
                                            seed=1), num_clients=6, partition='dirichlet', seed=3, alpha=0.5,
                             public_size=40)
  return Federation(feddf(FedDFConfig(server_steps=3, server_batch_size=8), 4, data.public), data,
                    ModelConfig(('small_cnn_narrow', 'mlp'), 16), LocalTraining(0.05, 8), join_ratio=0.5)


def test_feddf_teachers_are_every_participant_and_an_absent_architecture_keeps_its_model(feddf_federation):
  fed = feddf_federation
  state = fed.init()
  models, stats = jax.jit(lambda groups: ([jax.tree.map(lambda a: a[:2], g.params) for g in groups],
                                          [jax.tree.map(lambda a: a[:2], g.model_state) for g in groups]))(state.groups)
  # distinct models in the two slots of the first group
  models[0] = jax.jit(lambda m: jax.tree.map(lambda a: a.at[1].multiply(-2.0), m))(models[0])
  x = fed.data.public.x[:5]
  one = lambda gi, s: fed.groups[gi].model.apply({'params': jax.tree.map(lambda a: a[s], models[gi]),
                                                  **jax.tree.map(lambda a: a[s], stats[gi])}, x, train=False)[0]
  uploads = (Uploads(GroupState(models[0], stats[0]), jnp.array([True, True]), jnp.ones(2)),
             Uploads(GroupState(models[1], stats[1]), jnp.array([True, False]), jnp.ones(2)))
  np.testing.assert_allclose(jax.jit(lambda u: ensemble_logits(fed.spec, u, x))(uploads),
                             jax.jit(lambda: (one(0, 0) + one(0, 1) + one(1, 0)) / 3)(), rtol=1e-5, atol=1e-6)
  nobody = uploads[1]._replace(mask=jnp.array([False, False]))
  new, _ = server_step(fed.algorithm.phases[0], fed.spec)(state.server, (uploads[0], nobody), jax.random.PRNGKey(0),
                                                          fed.constants)
  tree_allclose(new.models[1], state.server.models[1], rtol=0, atol=0)       # no participant: kept
  mean = jax.tree.map(lambda a: np.asarray(a).mean(0), models[0])
  moved = max(np.abs(np.asarray(a) - b).max() for a, b in zip(jax.tree.leaves(new.models[0]), jax.tree.leaves(mean)))
  assert moved > 0  # the group's mean, then distilled


def test_feddf_stops_each_architecture_patience_steps_after_its_best_and_keeps_that_student(monkeypatch):
  """The code's early stopping with scores by hand: steps at most 60, a validation every 10, patience 20. A
  student's 'parameters' count its steps; architecture A scores 0.1, 0.3, 0.2, 0.2 at steps 10-40: its best is step
  20, and at step 40 twenty steps have passed, so it stops there and keeps the student of step 20. B improves at
  every validation and runs to step 60. A stopped student takes no more steps."""
  import importlib
  import types
  feddf_module = importlib.import_module('fedjax_het.methods.feddf')
  scores = {0: [0.1, 0.3, 0.2, 0.2, 0.25, 0.9], 1: [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]}
  table = jnp.asarray([scores[0], scores[1]])
  spec = types.SimpleNamespace(groups=(0, 1))
  monkeypatch.setattr(feddf_module, 'validation_accuracy',
                      lambda g, p, s, c: table[g, jnp.clip(p.astype(jnp.int32) // 10 - 1, 0, 5)])
  taken = []

  def step(t, carry, active):
    params, states, opt = carry
    return tuple(p + active[g] for g, p in enumerate(params)), states, opt
  cfg = FedDFConfig(server_steps=60, eval_every=10, patience=20)
  init = ((jnp.float32(0), jnp.float32(0)), (jnp.float32(0), jnp.float32(0)), ((), ()))
  params, _ = feddf_module.early_stopped(cfg, spec, step, init, {})
  assert [float(p) for p in params] == [20.0, 60.0]


def test_feddf_early_stopping_reads_held_out_labelled_rows_and_refuses_to_run_without(tiny_data):
  data = make_federated_data(make_synthetic(num_samples=480, image_shape=(8, 8, 1), num_classes=4, noise=0.3,
                                            seed=1), num_clients=6, partition='dirichlet', seed=3, alpha=0.5,
                             public_size=40, validation_size=48)
  pool = 600  # the 480 training rows and 120 test rows merged (the pooled protocol)
  assert data.public.validation_x.shape == (48, 8, 8, 1) and len(data.dataset.y) == pool - 40 - 48
  fed = Federation(feddf(FedDFConfig(server_steps=20, server_batch_size=8, patience=10, eval_every=5), 4,
                         data.public), data, ModelConfig(('small_cnn_narrow', 'mlp'), 16), LocalTraining(0.05, 8),
                   join_ratio=0.5)
  state, _ = fed.round(fed.init())
  assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(state.server))
  with pytest.raises(ConfigError, match='patience=10: FedDF stops early on the server.s labelled validation'):
    feddf(FedDFConfig(patience=10), 4, data.public._replace(validation_x=None, validation_y=None))
  with pytest.raises(ConfigError, match='validation_size=48: the server.s validation rows serve'):
    make_federated_data(make_synthetic(num_samples=480, image_shape=(8, 8, 1), num_classes=4, noise=0.3, seed=1),
                        num_clients=6, partition='dirichlet', seed=3, validation_size=48)


def test_fedmd_stages_run_over_the_public_rows_and_only_the_revisit_is_capped(tiny_data):
  data = make_federated_data(make_synthetic(num_samples=480, image_shape=(8, 8, 1), num_classes=4, noise=0.3,
                                            seed=1), num_clients=6, partition='dirichlet', seed=3, alpha=0.5,
                             public_size=40)
  cfg = FedMDConfig(transfer_public_epochs=2, transfer_private_epochs=1, digest_epochs=1, digest_batch_size=16)
  fed = Federation(fedmd(cfg, 4, data.public), data, ModelConfig(('small_cnn_narrow', 'mlp'), 16),
                   LocalTraining(0.05, 8, max_steps=2), rounds=2, join_ratio=0.5)
  everyone, sizes = fed.participants(0), fed.train_sizes
  assert len(everyone) == 6  # the transfer round trains every client
  transfer = fed.local_work(everyone, 0)
  # public: 2 epochs of 40 // 16 = 2 steps of 16 rows; private: one whole epoch of n // 8 steps (not capped at 2)
  assert transfer['local_steps'] == sum(2 * 2 + n // 8 for n in sizes)
  assert transfer['local_samples'] == sum(2 * 2 * 16 + n // 8 * 8 for n in sizes)
  later = fed.participants(1)
  collaborate = fed.local_work(later, 1)
  assert collaborate['local_steps'] == sum(2 + min(2, sizes[k] // 8) for k in later)


@pytest.mark.slow
def test_fedmd_resumed_at_its_phase_boundary_ends_where_the_uninterrupted_run_ends(tmp_path):
  data = make_federated_data(make_synthetic(num_samples=240, image_shape=(8, 8, 1), num_classes=4, noise=0.3,
                                            seed=1), num_clients=4, partition='dirichlet', seed=3, alpha=0.5,
                             public_size=24)
  make = lambda: Federation(fedmd(FedMDConfig(transfer_public_epochs=1, transfer_private_epochs=1,
                                              digest_batch_size=8), 4, data.public), data,
                            ModelConfig(('mlp',), 16), LocalTraining(0.05, 8), rounds=3, join_ratio=0.5)
  fed = make()
  final, history = run_rounds(fed, fed.init(), 3)
  first, head = run_rounds(fed, fed.init(), 1)
  checkpoints = Checkpoints(str(tmp_path / 'ckpt'))
  checkpoints.save(first)
  fresh = make()
  restored = checkpoints.restore(fresh.init(), checkpoints.latest_round())
  state, rest = run_rounds(fresh, restored, 2)
  tree_allclose(state.groups, final.groups, rtol=0, atol=0)
  tree_allclose(state.server, final.server, rtol=0, atol=0)
  assert head + rest == history and [h['phase'] for h in history] == ['transfer', 'collaborate', 'collaborate']


# ---------------------------------------------------------------------------------------------------- FedALA
def test_fedala_head_mixing_and_weight_step_by_hand():
  from fedjax_het.methods.fedala import ala_head, ala_weight_step, settled
  local, group = {'k': jnp.array([1.0, 2.0, 3.0])}, {'k': jnp.array([3.0, 2.0, -1.0])}
  np.testing.assert_allclose(ala_head(local, group, {'k': jnp.array([0.5, 1.0, 0.25])})['k'], [2.0, 2.0, 2.0])
  # W - eta * grad * (g - l) = [0.5 - 0.1 * 2 * 2, 0.5, 0.5 - 0.1 * (-3) * (-4)], clipped to [0, 1]
  stepped = ala_weight_step({'k': jnp.full(3, 0.5)}, {'k': jnp.array([2.0, 5.0, -3.0])}, local, group, 0.1)
  np.testing.assert_allclose(stepped['k'], [0.1, 0.5, 0.0], atol=1e-7)
  np.testing.assert_allclose(ala_weight_step({'k': jnp.full(3, 0.9)}, {'k': jnp.array([-1.0, 0.0, 0.0])}, local,
                                             group, 1.0)['k'], [1.0, 0.9, 0.9])
  # np.std([1, 1.1, 1, 1.1]) = 0.05: settled once more epochs than the window have run
  window = jnp.array([1.0, 1.1, 1.0, 1.1])
  assert bool(settled(window, 5, 0.1)) and not bool(settled(window, 4, 0.1)) and not bool(settled(window, 5, 0.01))


def test_fedala_keeps_a_model_equal_to_the_groups_and_mixes_only_the_head_otherwise(tiny_data):
  from fedjax_het.methods import FedALAConfig, fedala
  from fedjax_het.methods.fedala import adaptive_local_aggregation
  from fedjax_het.core import ClientRows
  fed = Federation(fedala(FedALAConfig(max_start_epochs=30), 4), tiny_data,
                   ModelConfig(('small_cnn_narrow',), 16), LocalTraining(0.05, 8))
  state = fed.init()
  client = jax.tree.map(lambda a: a[0], state.groups[0])
  g = fed.groups[0]
  rows = ClientRows(g.train.x[0], g.train.y[0], g.train.n[0], g.train.n[0])
  ala = jax.jit(lambda c, p, k: adaptive_local_aggregation(g.model, FedALAConfig(max_start_epochs=30), 8, c, rows, p,
                                                           k))
  same = ala(client, client.params, jax.random.PRNGKey(0))
  tree_allclose(same, client, rtol=0, atol=0)  # the first round: no ALA, the start phase still ahead
  group = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.PRNGKey(1), a.shape), client.params)
  out = ala(client, group, jax.random.PRNGKey(0))
  tree_allclose(out.params['extractor'], group['extractor'], rtol=0, atol=0)  # lower layers: the group's
  weights = out.extra.weights
  assert bool(out.extra.started)
  for w, l, gp, h in zip(*(jax.tree.leaves(t) for t in (weights, client.params['head'], group['head'],
                                                        out.params['head']))):
    assert float(w.min()) >= 0 and float(w.max()) <= 1
    np.testing.assert_allclose(h, l + (gp - l) * w, rtol=1e-5, atol=1e-6)
  assert any(float(jnp.abs(w - 1).max()) > 0 for w in jax.tree.leaves(weights))  # learned, not left at ones


# ---------------------------------------------------------------------------------------------------- HeteroFL
def test_heterofl_clips_each_steps_gradient_to_norm_one_before_decay_and_momentum_by_hand():
  """Its code's `Local.train`: clip_grad_norm_(params, 1), then torch SGD (lr 0.1, momentum 0.9, weight decay 0.01)
  adds the decay to the clipped gradient. Gradient (3, 4) at parameters (1, 1): clipped (0.6, 0.8), plus decay
  (0.61, 0.81), first step -0.1 times that; the second step's gradient (0.3, 0) is within the norm: momentum
  0.9 * (0.61, 0.81) + (0.3, 0) + 0.01 * (0.939, 0.919)."""
  from fedjax_het.methods import HeteroFLConfig
  from fedjax_het.methods.heterofl import local_optimizer
  optimizer = local_optimizer(HeteroFLConfig(momentum=0.9, weight_decay=0.01), 0.1)
  params = jnp.asarray([1.0, 1.0])
  state = optimizer.init(params)
  step, state = optimizer.update(jnp.asarray([3.0, 4.0]), state, params)
  np.testing.assert_allclose(step, [-0.061, -0.081], rtol=1e-6)
  params = params + step
  step, state = optimizer.update(jnp.asarray([0.3, 0.0]), state, params)
  trace = 0.9 * np.asarray([0.61, 0.81]) + np.asarray([0.3, 0.0]) + 0.01 * np.asarray([0.939, 0.919])
  np.testing.assert_allclose(step, -0.1 * trace, rtol=1e-6)
  unclipped = local_optimizer(HeteroFLConfig(momentum=0.0, weight_decay=0.0, clip_norm=0.0), 0.1)
  np.testing.assert_allclose(unclipped.update(jnp.asarray([3.0, 4.0]), unclipped.init(params), params)[0],
                             [-0.3, -0.4], rtol=1e-6)


def test_heterofl_sub_models_are_leading_slices_and_entries_average_over_their_holders():
  from fedjax_het.methods.heterofl import HeteroFLUpload, combine, sub_model
  w = jnp.arange(9.0).reshape(3, 3)
  glob = {'w': w, 'head': {'kernel': jnp.zeros((3, 2)), 'bias': jnp.zeros(2)}}
  small = sub_model(glob, {'w': jnp.zeros((2, 2)), 'head': {'kernel': jnp.zeros((2, 2)), 'bias': jnp.zeros(2)}})
  np.testing.assert_array_equal(small['w'], [[0.0, 1.0], [3.0, 4.0]])
  # width 3: one participant (all ones); width 2: two participants (2s and 4s) and an empty slot (100s)
  wide = Uploads(HeteroFLUpload({'w': jnp.ones((1, 3, 3)),
                                 'head': {'kernel': jnp.ones((1, 3, 2)), 'bias': jnp.ones((1, 2))}},
                                jnp.array([[1.0, 1.0]])), jnp.array([True]), jnp.ones(1))
  narrow = Uploads(HeteroFLUpload({'w': jnp.stack([jnp.full((2, 2), 2.0), jnp.full((2, 2), 4.0), jnp.full((2, 2), 100.0)]),
                                   'head': {'kernel': jnp.stack([jnp.full((2, 2), 2.0), jnp.full((2, 2), 4.0),
                                                                 jnp.full((2, 2), 100.0)]),
                                            'bias': jnp.stack([jnp.full(2, 2.0), jnp.full(2, 4.0),
                                                               jnp.full(2, 100.0)])}},
                                  jnp.array([[1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])),
                   jnp.array([True, True, False]), jnp.ones(3))
  out = combine(glob, (wide, narrow))
  # top-left 2x2: (1 + 2 + 4) / 3; the rest only the wide participant's 1
  np.testing.assert_allclose(out['w'], [[7 / 3, 7 / 3, 1.0], [7 / 3, 7 / 3, 1.0], [1.0, 1.0, 1.0]], rtol=1e-6)
  # head: class 0 held by all three, class 1 by the wide one and the second narrow one only (not by the first)
  np.testing.assert_allclose(out['head']['kernel'], [[7 / 3, 5 / 2], [7 / 3, 5 / 2], [1.0, 1.0]], rtol=1e-6)
  np.testing.assert_allclose(out['head']['bias'], [7 / 3, 5 / 2], rtol=1e-6)
  kept = combine(glob, (wide._replace(mask=jnp.array([False])), narrow))
  np.testing.assert_allclose(kept['w'], [[3.0, 3.0, 2.0], [3.0, 3.0, 5.0], [6.0, 7.0, 8.0]])  # nobody: kept


def test_width_scaled_models_narrow_every_hidden_width_and_refuse_what_cannot_be_sliced():
  from fedjax_het.models.registry import build_model
  shapes = lambda name: jax.eval_shape(lambda: build_model(name, 10, 16, 'none').init(
      jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3))))['params']
  half, full = shapes('resnet10@0.5'), shapes('resnet10')
  assert half['extractor']['Conv_0']['kernel'].shape == (7, 7, 3, 32)  # ceil(0.5 * 64)
  assert half['head']['kernel'].shape == (256, 10) and full['head']['kernel'].shape == (512, 10)
  assert shapes('heterofl_conv@0.3')['head']['kernel'].shape == (154, 10)  # ceil(0.3 * 512)
  with pytest.raises(ConfigError, match="'cnn4@0.5': 'cnn4' has no width-scaled form"):
    build_model('cnn4@0.5', 10)
  with pytest.raises(ConfigError, match=r'must be a number in \(0, 1\]'):
    build_model('resnet10@2', 10)


def test_public_images_reach_the_programs_as_arguments_not_compiled_constants(feddf_federation):
  """The FedDF server step and the broadcast carry the public images as an argument (`Algorithm.constants`): its
  compiled text does not hold them, so a CIFAR-sized public set is not compiled into every program."""
  fed = feddf_federation
  state = fed.init()
  shape = 'x'.join(str(d) for d in fed.data.public.x.shape)
  step = jax.jit(fed._server_step(fed.algorithm.phases[0]))
  uploads = tuple(Uploads(GroupState(g.params, g.model_state), jnp.ones(g.params['head']['bias'].shape[0], bool),
                          jnp.ones(2))
                  for g in state.groups)
  text = step.lower(state.server, uploads, jax.random.PRNGKey(0), fed.constants).as_text()
  assert not [line for line in text.splitlines() if 'constant' in line and f'tensor<{shape}xf32>' in line]
  assert isinstance(step(state.server, uploads, jax.random.PRNGKey(0), fed.constants)[0], GroupStates)
  public = lambda tree: [a for a in jax.tree.leaves(tree) if a.shape == fed.data.public.x.shape]
  assert public(fed.constants) and not public(fed.sent(state.server, 0, 0))  # never sent


@pytest.mark.slow
def test_heterofl_multisteplr_scales_the_rounds_rate_as_a_lower_rate_would(tiny_data):
  """torch's MultiStepLR stepped every round: the factor 0.1^k after k milestones (by hand at 149, 150, 249, 250);
  a run whose milestone 0 halves the rate from the first round ends its round where a run at half the rate does,
  and the server's round counter moves the factor."""
  from fedjax_het.methods import HeteroFLConfig, heterofl
  from fedjax_het.optim import multistep_factor
  assert [float(multistep_factor(r, (150, 250), 0.1)) for r in (149, 150, 249, 250)] == pytest.approx(
      [1.0, 0.1, 0.1, 0.01])

  def one_round(cfg, rate):
    fed = Federation(heterofl(cfg, 4), tiny_data, ModelConfig(('heterofl_conv@0.125', 'heterofl_conv@0.0625'),
                     16, 'none'), LocalTraining(rate, 8))
    state, _ = fed.round(fed.init())
    return fed, state
  fed, halved = one_round(HeteroFLConfig(lr_milestones='0', lr_decay=0.5), 0.1)
  _, slower = one_round(HeteroFLConfig(), 0.05)
  for a, b in zip(jax.tree.leaves(halved.server.model), jax.tree.leaves(slower.server.model)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert float(fed.sent(halved.server, 0, 1).lr_scale) == 0.5
  later = Federation(heterofl(HeteroFLConfig(lr_milestones='1,3', lr_decay=0.5), 4), tiny_data,
                     ModelConfig(('heterofl_conv@0.125', 'heterofl_conv@0.0625'), 16, 'none'), LocalTraining(0.1, 8))
  state = later.init()
  scales = []
  for r in range(4):
    scales.append(float(later.sent(state.server, 0, r).lr_scale))
    state, _ = later.round(state)
  assert scales == [1.0, 0.5, 0.5, 0.25]
  with pytest.raises(ConfigError, match='lr_milestones=.150,x. must list rounds'):
    HeteroFLConfig(lr_milestones='150,x')


def test_heterofl_scores_do_not_depend_on_how_the_test_rows_are_padded(tiny_data):
  from fedjax_het.methods import HeteroFLConfig, heterofl
  from fedjax_het.data.federated import ClientArrays
  from fedjax_het.engine.client import score_client
  fed = Federation(heterofl(HeteroFLConfig(static_bn=False), 4), tiny_data,
                   ModelConfig(('heterofl_conv@0.125', 'heterofl_conv@0.0625'), 16, 'none'), LocalTraining(0.05, 8))
  state = fed.init()
  client = jax.tree.map(lambda a: a[0], state.groups[1])
  broadcast = fed.broadcast(state.server, 1, 0)
  x = jax.random.normal(jax.random.PRNGKey(3), (37, 8, 8, 1))
  y = jnp.arange(37) % 4
  score = lambda pad, chunk: int(score_client(fed.evaluations[1], client, broadcast, ClientArrays(
      jnp.pad(x, [(0, pad)] + [(0, 0)] * 3), jnp.pad(y, (0, pad)), jnp.asarray(37)), chunk)[0])
  # one pass over the rows each time: the batch's statistics are those of the same 37 real rows
  assert score(0, 256) == score(20, 256) == score(191, 256)


def test_batch_statistics_by_hand():
  import flax.linen as nn
  from fedjax_het.models.norm import TorchBatchNorm, batch_statistics

  class OneNorm(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
      return TorchBatchNorm(use_running_average=not train)(x)
  x = jnp.array([[1.0, 10.0], [3.0, 20.0], [100.0, -5.0]])
  variables = OneNorm().init(jax.random.PRNGKey(0), x)
  stats = batch_statistics(OneNorm(), variables, x, jnp.array([True, True, False]))['BatchNorm_0']
  np.testing.assert_allclose(stats['mean'], [2.0, 15.0], rtol=1e-6)  # the real rows only
  np.testing.assert_allclose(stats['var'], [2.0, 50.0], rtol=1e-5)  # unbiased, torch's: ((1-2)^2 + (3-2)^2) / 1


@pytest.mark.parametrize('strategy', ['sequential', pytest.param('vmap', marks=pytest.mark.slow)])
def test_heterofl_static_batchnorm_reads_every_clients_training_rows(tiny_data, strategy):
  """sBN: the first BatchNorm's mean is the mean, over every real training row of every client and its positions,
  of the global model's first convolution (a mean of chunk means weighted by their rows is the global mean)."""
  from fedjax_het.methods import HeteroFLConfig, heterofl
  from fedjax_het.engine import ExecutionConfig
  fed = Federation(heterofl(HeteroFLConfig(), 4), tiny_data,
                   ModelConfig(('heterofl_conv@0.125', 'heterofl_conv@0.0625'), 16, 'none'), LocalTraining(0.05, 8),
                   ExecutionConfig(strategy=strategy, eval_batch_size=16))
  state = fed.init()
  totals = fed.evaluation_statistics(state, 0)
  first = jax.tree.map(lambda a: a / totals['rows'], totals['weighted'])
  first = first['extractor']['BatchNorm_0']  # HeteroFLConv's first BatchNorm, after its first convolution
  kernel = state.server.model['extractor']['Conv_0']
  rows = np.concatenate([np.asarray(g.train.x[i, :g.train_sizes[i]]) for g in fed.groups for i in range(g.size)])
  assert float(totals['rows']) == len(rows) == sum(int(g.train_sizes.sum()) for g in fed.groups)
  conv = jax.lax.conv_general_dilated(jnp.asarray(rows), kernel['kernel'], (1, 1), 'SAME',
                                      dimension_numbers=('NHWC', 'HWIO', 'NHWC')) + kernel['bias']
  np.testing.assert_allclose(first['mean'], conv.mean(axis=(0, 1, 2)), rtol=2e-4, atol=1e-6)
  metrics = fed.evaluate(state)
  assert 0.0 <= metrics['accuracy'] <= 1.0
  # A client's statistics do not depend on how far its group pads the rows (its shuffled order is of its real rows).
  from fedjax_het.data.federated import ClientArrays
  from fedjax_het.engine.client import client_statistics
  g = fed.groups[0]
  n = int(g.train_sizes[0])
  rows = lambda pad: ClientArrays(jnp.pad(g.train.x[0, :n], [(0, pad)] + [(0, 0)] * 3), jnp.zeros(n + pad, jnp.int32),
                                  jnp.asarray(n))
  client = jax.jit(lambda s: jax.tree.map(lambda a: a[0], s))(state.groups[0])
  gather = lambda pad: jax.jit(lambda c, b, r: client_statistics(fed.evaluations[0], g.spec.training, c, b, r, 8,
                                                                 jax.random.PRNGKey(5)))(
                                   client, fed.broadcast(state.server, 0, 0), rows(pad))
  tree_allclose(gather(0), gather(13), rtol=1e-6, atol=1e-6)
  with pytest.raises(ConfigError, match='--noheterofl_static_bn'):  # scored without gathering: refused
    fed.executor.correct(g, fed.evaluations[0], 0, state.groups[0], fed.broadcast(state.server, 0, 0),
                         fed.global_test if fed.global_test is not None else g.test, 'global')


def _first_conv_by_hand(x: np.ndarray, kernel: np.ndarray, bias: np.ndarray) -> np.ndarray:
  """HeteroFL's CNN's first 3x3 convolution (padding 1) in numpy: [B, H, W, C] -> [B, H, W, O]."""
  b, h, w, _ = x.shape
  padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
  out = np.zeros((b, h, w, kernel.shape[-1]))
  for dh in range(3):
    for dw in range(3):
      out += padded[:, dh:dh + h, dw:dw + w] @ kernel[dh, dw]
  return out + bias


def _pass_by_hand(outputs, orders, batch):
  """The row-weighted mean over every client's batches (each client's rows in `orders`, batches of `batch`) of
  each batch's per-channel unbiased variance: what the statistics pass gives a BatchNorm's 'var'."""
  total, rows = 0.0, 0
  for out, order in zip(outputs, orders):
    for start in range(0, len(order), batch):
      part = out[order[start:start + batch]].reshape(-1, out.shape[-1])
      total, rows = total + part.var(0, ddof=1) * len(order[start:start + batch]), rows + len(order[start:start + batch])
  return total / rows


@pytest.mark.parametrize('strategy', ['sequential', pytest.param('vmap', marks=pytest.mark.slow)])
def test_heterofl_static_batchnorm_shuffles_class_sorted_rows(strategy):
  """HeteroFL's `stats` pass reads a shuffled train loader: on clients whose rows are stored class by class (the
  global protocol's partition), the variance of sBN's first BatchNorm is the rows-weighted mean of the variances of
  shuffled batches of 8 (numpy, on the rows in the order the client's statistics key draws), close to numpy's own
  shuffles' average and far above the stored order's, whose batches hold one class."""
  from fedjax_het.methods import HeteroFLConfig, heterofl
  from fedjax_het.engine import ExecutionConfig
  from fedjax_het.rows import shuffled_real_rows
  data = make_federated_data(make_synthetic(num_samples=240, image_shape=(8, 8, 1), num_classes=4, noise=0.1,
                                            seed=1), num_clients=4, partition='iid', seed=3, protocol='global')
  fed = Federation(heterofl(HeteroFLConfig(), 4), data,
                   ModelConfig(('heterofl_conv@0.125', 'heterofl_conv@0.0625'), 16, 'none'), LocalTraining(0.05, 8),
                   ExecutionConfig(strategy=strategy, eval_batch_size=16))
  state = fed.init()
  var = np.asarray(jax.tree.map(lambda a: a / fed.evaluation_statistics(state, 0)['rows'], fed.evaluation_statistics(
      state, 0)['weighted'])['extractor']['BatchNorm_0']['var'])
  kernel = {k: np.asarray(v, np.float64) for k, v in state.server.model['extractor']['Conv_0'].items()}
  clients = [(g, i) for g in fed.groups for i in range(g.size)]
  labels = [np.asarray(g.train.y[i, :g.train_sizes[i]]) for g, i in clients]
  stored_batches = [lab[s:s + 8] for lab in labels for s in range(0, len(lab), 8)]
  assert np.mean([len(set(b.tolist())) == 1 for b in stored_batches]) > 0.6  # stored class by class
  outputs = [_first_conv_by_hand(np.asarray(g.train.x[i, :g.train_sizes[i]], np.float64), kernel['kernel'],
                                 kernel['bias']) for g, i in clients]
  clients_key = fed.round_keys(0)[0]
  orders = []
  for (g, i), out in zip(clients, outputs):  # the documented draw: fold_in(fold_in(round key, 'STA'), client id), 0
    key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(clients_key, 0x535441), int(g.clients[i])), 0)
    orders.append(np.asarray(shuffled_real_rows(key, jnp.ones(len(out), bool))))
    assert sorted(orders[-1].tolist()) == list(range(len(out)))
  np.testing.assert_allclose(var, _pass_by_hand(outputs, orders, 8), rtol=1e-4, atol=1e-7)
  rng = np.random.default_rng(0)
  shuffled = np.mean([_pass_by_hand(outputs, [rng.permutation(len(o)) for o in outputs], 8) for _ in range(50)], 0)
  stored = _pass_by_hand(outputs, [np.arange(len(o)) for o in outputs], 8)
  np.testing.assert_allclose(var, shuffled, rtol=0.05)
  assert var.sum() > 1.1 * stored.sum(), (var, stored)  # one-class batches miss the spread between classes


@pytest.mark.slow
def test_heterofl_static_batchnorm_augments_as_training_does():
  """With --augment the statistics pass reads each batch cropped and flipped as a training batch is (HeteroFL's
  `stats` reads its train loader's transforms): the first BatchNorm's mean equals numpy's over the rows of each
  shuffled batch through `augment_batch` with the batch's key, and differs from the unaugmented pass."""
  from fedjax_het.methods import HeteroFLConfig, heterofl
  from fedjax_het.data.augment import augment_batch
  from fedjax_het.rows import shuffled_real_rows
  data = make_federated_data(make_synthetic(num_samples=120, image_shape=(8, 8, 1), num_classes=4, noise=0.3,
                                            seed=1), num_clients=2, partition='iid', seed=3, protocol='global')
  models = ModelConfig(('heterofl_conv@0.125', 'heterofl_conv@0.0625'), 16, 'none')
  means = {}
  for augment in ('none', 'crop_flip'):
    fed = Federation(heterofl(HeteroFLConfig(), 4), data, models, LocalTraining(0.05, 8, augment=augment))
    state = fed.init()
    totals = fed.evaluation_statistics(state, 0)
    means[augment] = np.asarray(totals['weighted']['extractor']['BatchNorm_0']['mean'] / totals['rows'])
  kernel = {k: np.asarray(v, np.float64) for k, v in state.server.model['extractor']['Conv_0'].items()}
  total, rows = 0.0, 0
  for g in fed.groups:
    for i in range(g.size):
      x, n = np.asarray(g.train.x[i]), int(g.train_sizes[i])
      key = jax.random.fold_in(jax.random.fold_in(fed.round_keys(0)[0], 0x535441), int(g.clients[i]))
      order = np.asarray(shuffled_real_rows(jax.random.fold_in(key, 0), jnp.arange(x.shape[0]) < n))
      for p, start in enumerate(range(0, n, 8)):
        batch = np.asarray(augment_batch(jnp.asarray(x[order[start:start + 8]]), jax.random.fold_in(key, p + 1),
                                         'crop_flip', (-1.0,)), np.float64)
        out = _first_conv_by_hand(batch, kernel['kernel'], kernel['bias'])
        total, rows = total + out.sum((0, 1, 2)), rows + out.shape[0] * out.shape[1] * out.shape[2]
  np.testing.assert_allclose(means['crop_flip'], total / rows, rtol=1e-4, atol=1e-6)
  assert np.abs(means['crop_flip'] - means['none']).max() > 1e-3


def test_heterofl_static_batchnorm_is_refused_over_flower(tiny_data):
  pytest.importorskip('flwr')
  from fedjax_het.methods import HeteroFLConfig, heterofl
  from fedjax_het.flower.rounds import FlowerRounds
  fed = Federation(heterofl(HeteroFLConfig(), 4), tiny_data,
                   ModelConfig(('heterofl_conv@0.125', 'heterofl_conv@0.0625'), 16, 'none'), LocalTraining(0.05, 8))
  with pytest.raises(ConfigError, match='--noheterofl_static_bn'):
    FlowerRounds(fed, None, '{}', 1, 1)


def test_heterofl_refuses_an_rm_that_pools_every_width_to_d(tiny_data):
  from fedjax_het.methods import HeteroFLConfig, heterofl
  fed = Federation(heterofl(HeteroFLConfig(), 4), tiny_data,
                   ModelConfig(('heterofl_conv@0.125', 'heterofl_conv@0.0625'), 16, 'ap'), LocalTraining(0.05, 8))
  with pytest.raises(ConfigError, match="rm='ap': HeteroFL slices"):
    fed.init()


def test_public_data_mistakes_are_named():
  from fedjax_het.data import PublicData
  with pytest.raises(ConfigError, match='labels up to 5 where the run has 4 classes'):
    fedmd(FedMDConfig(), 4, PublicData(np.zeros((2, 8, 8, 1)), np.array([0, 5]), 'other'))
  cfg = ExperimentConfig(algorithm='feddf', dataset='synthetic:8,8,1', public_dataset='nosuchset', num_clients=4,
                         models=('mlp',), feature_dim=16, rounds=2, batch_size=16)
  with pytest.raises(ConfigError, match="--public_dataset='nosuchset' is unknown"):
    build_federation(cfg)


def test_noised_batchnorm_variances_are_clipped_at_zero():
  from fedjax_het.methods.avgkd import nonnegative_variances
  state = {'batch_stats': {'bn': {'mean': jnp.array([-1.0]), 'var': jnp.array([-0.5, 2.0])}}}
  out = nonnegative_variances(state)
  np.testing.assert_array_equal(out['batch_stats']['bn']['var'], [0.0, 2.0])
  np.testing.assert_array_equal(out['batch_stats']['bn']['mean'], [-1.0])


# Two in the default run: FedGKT's per-client server logits and kept optimisers, HeteroFL's server round counter
# (its learning-rate schedule); the others' per-client states checkpoint through the same pytree path.
SLOW = pytest.mark.slow


@pytest.mark.parametrize('name', [pytest.param('feddf', marks=SLOW), pytest.param('avgkd', marks=SLOW),
                                  pytest.param('fedala', marks=SLOW), pytest.param('heterofl', marks=SLOW),
                                  pytest.param('fedgkt', marks=SLOW),
                                  pytest.param('pfedafm', marks=SLOW), pytest.param('fedtype', marks=SLOW)])
def test_resumed_after_round_one_ends_where_the_golden_run_ends(name, tmp_path):
  """Round 1 of the golden run, a checkpoint, a fresh federation restored from it and round 2: the golden run's
  final state and metrics exactly (AvgKD crosses its phase boundary there)."""
  from golden import golden_federation, make_golden_federation
  fed = make_golden_federation(name)
  first, head = run_rounds(fed, fed.init(), 1)
  checkpoints = Checkpoints(str(tmp_path / 'ckpt'))
  checkpoints.save(first)
  fresh = make_golden_federation(name)
  state, rest = run_rounds(fresh, checkpoints.restore(fresh.init(), checkpoints.latest_round()), 1)
  _, final, history = golden_federation(name)
  tree_allclose(state.groups, final.groups, rtol=0, atol=0)
  tree_allclose(state.server, final.server, rtol=0, atol=0)
  timeless = lambda rows: [{k: v for k, v in r.items() if 'seconds' not in k} for r in rows]
  assert head + rest == timeless(history)


@pytest.mark.slow  # the dynamic split's default-run checks: test_heterofl_dynamic_split_draws_a_rate_per_participant_and_round
def test_heterofl_dynamic_sub_model_steps_equal_the_sliced_sub_models():
  """The dynamic split trains the global model with the entries outside the drawn rate's leading slices zero: its
  train-mode logits, its loss's gradient and one clipped SGD step (HeteroFL's local step) equal the sliced
  sub-model's on those slices, and leave every other entry zero."""
  from fedjax_het.methods import HeteroFLConfig
  from fedjax_het.methods.heterofl import local_optimizer, rate_masks, sub_model, variables
  from fedjax_het.models.forward import forward
  from fedjax_het.methods.shared.common import cross_entropy
  data = make_federated_data(make_synthetic(num_samples=80, image_shape=(8, 8, 1), num_classes=4, noise=0.3,
                                            seed=1), num_clients=2, partition='iid', seed=3)
  fed = Federation(heterofl_for(HeteroFLConfig(split='dynamic', dynamic_rates='1,0.5')), data,
                   ModelConfig(('heterofl_conv@0.125',), 16, 'none'), LocalTraining(0.05, 8))
  group = fed.groups[0].spec
  masks = rate_masks(HeteroFLConfig(dynamic_rates='1,0.5'), group)
  full = group.model
  small = group.build_model('heterofl_conv@0.0625')
  variables_full = full.init(jax.random.PRNGKey(1), group.sample_input(), train=False)
  params = jax.tree.map(lambda p, m: p * m[1], variables_full['params'], masks)
  state = {k: v for k, v in variables_full.items() if k != 'params'}
  small_params = sub_model(variables_full['params'], variables(group, small)['params'])
  small_state = sub_model(state, {k: v for k, v in variables(group, small).items() if k != 'params'})
  x = jax.random.normal(jax.random.PRNGKey(2), (8, 8, 8, 1))
  y = jnp.arange(8) % 4
  loss = lambda model, st: lambda p: cross_entropy(forward(model, p, st, x, True)[0], y)
  value_full, grad_full = jax.value_and_grad(loss(full, state))(params)
  value_small, grad_small = jax.value_and_grad(loss(small, small_state))(small_params)
  assert float(value_full) == pytest.approx(float(value_small), rel=1e-5)
  tree_allclose(sub_model(grad_full, small_params), grad_small, rtol=1e-4, atol=1e-6)
  for g, m in zip(jax.tree.leaves(grad_full), jax.tree.leaves(masks)):
    np.testing.assert_array_equal(np.asarray(g) * (1 - m[1]), 0.0)
  opt = local_optimizer(HeteroFLConfig(), 0.1)
  step = lambda p, g: optax.apply_updates(p, opt.update(g, opt.init(p), p)[0])
  stepped_full, stepped_small = step(params, grad_full), step(small_params, grad_small)
  tree_allclose(sub_model(stepped_full, small_params), stepped_small, rtol=1e-4, atol=1e-6)
  for p, m in zip(jax.tree.leaves(stepped_full), jax.tree.leaves(masks)):
    np.testing.assert_array_equal(np.asarray(p) * (1 - m[1]), 0.0)


def heterofl_for(cfg):
  from fedjax_het.methods import heterofl
  return heterofl(cfg, 4)


def test_heterofl_dynamic_split_draws_a_rate_per_participant_and_round():
  """--heterofl_split=dynamic: every participant draws a rate each round (both rates drawn over three rounds of six
  clients, not always the same per client), uploads only its rate's entries (counted as the sub-model), and the
  server averages each entry over the participants whose rate holds it (an entry only rate 1 holds moves only in
  a round where someone drew rate 1)."""
  from fedjax_het.methods import HeteroFLConfig
  from fedjax_het.methods.heterofl import rate_masks
  fed = Federation(heterofl_for(HeteroFLConfig(split='dynamic', dynamic_rates='1,0.5')), tiny_data_for_dynamic(),
                   ModelConfig(('heterofl_conv@0.125',), 16, 'none'), LocalTraining(0.05, 8))
  masks = rate_masks(HeteroFLConfig(dynamic_rates='1,0.5'), fed.groups[0].spec)
  sizes = [int(sum(m[r].sum() for m in jax.tree.leaves(masks))) for r in range(2)]
  state = fed.init()
  drawn = []
  for r in range(3):
    before = jax.device_get(state.server.model)
    joined = fed.participants(r)
    state, m = fed.round(state)
    rates = np.asarray(state.groups[0].extra.rate)[joined]
    drawn.append(rates)
    assert m['upload_model_scalars'] == sum(sizes[k] for k in rates)
    assert m['broadcast_scalars'] == sum(sizes[k] for k in rates)
    outer = jax.tree.map(lambda a, b, mk: np.abs(np.asarray(a) - b)[mk[0] > mk[1]].max(initial=0.0),
                         state.server.model, before, masks)
    moved = max(jax.tree.leaves(outer))
    assert (moved > 0) == bool((rates == 0).any())
  drawn = np.concatenate(drawn)
  assert set(drawn.tolist()) == {0, 1}
  # combine by hand: a rate-1 participant's 2s and a rate-1/2 one's 4s (zeros outside its slices): 3 where both
  # hold an entry, 2 where only the first does (not the 1 of counting the second's zeros)
  from fedjax_het.methods.heterofl import HeteroFLUpload, combine
  from fedjax_het.uploads import Uploads
  model = jax.device_get(state.server.model)
  both = jax.tree.map(lambda a, m: np.stack([np.full(a.shape, 2.0), 4.0 * m[1]]), model, masks)
  u = Uploads(HeteroFLUpload(both, jnp.ones((2, 4)), jnp.array([0, 1])), jnp.array([True, True]), jnp.ones(2))
  out = combine(model, (u,), masks)
  for o, m in zip(jax.tree.leaves(out), jax.tree.leaves(masks)):
    np.testing.assert_allclose(np.asarray(o), np.where(m[1] > 0, 3.0, 2.0))
  with pytest.raises(ConfigError, match='heterofl_split=fix'):
    Federation(heterofl_for(HeteroFLConfig(split='dynamic')), tiny_data_for_dynamic(),
               ModelConfig(('heterofl_conv@0.125', 'heterofl_conv@0.0625'), 16, 'none'), LocalTraining(0.05, 8)).init()
  with pytest.raises(ConfigError, match='dynamic_rates'):
    HeteroFLConfig(dynamic_rates='1,0')


def tiny_data_for_dynamic():
  return make_federated_data(make_synthetic(num_samples=240, image_shape=(8, 8, 1), num_classes=4, noise=0.3,
                                            seed=1), num_clients=6, partition='dirichlet', seed=3, alpha=0.5)


def _adam_steps(opt_state) -> np.ndarray:
  """Per client, the steps an Adam state has taken (its ScaleByAdamState count)."""
  counts = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]
            if getattr(path[-1], 'name', None) == 'count']
  return np.asarray(counts[-1])


@pytest.mark.slow  # the paper code's digest variant (--fedmd_digest=mae), not the default
def test_fedmd_mae_keeps_the_classifiers_and_the_digests_adam_apart():
  """The paper's code (--fedmd_digest=mae) compiles the logits model and the classifier apart, each with its own
  Adam: after the transfer round the digest's Adam is fresh and the classifier's has taken the private stage's steps;
  after a round every participant's digest Adam has taken the digest's steps (24 public rows / 8 = 3) and its
  classifier's the revisit's on top. Felo's digest keeps one Adam for everything."""
  data = make_federated_data(make_synthetic(num_samples=240, image_shape=(8, 8, 1), num_classes=4, noise=0.3,
                                            seed=1), num_clients=4, partition='dirichlet', seed=3, alpha=0.5,
                             public_size=24)
  steps = {}
  for kind in ('mae', 'felo'):
    fed = Federation(fedmd(FedMDConfig(digest=kind, transfer_public_epochs=1, transfer_private_epochs=1,
                                       digest_batch_size=8), 4, data.public), data,
                     ModelConfig(('mlp',), 16), LocalTraining(0.05, 8), rounds=2, join_ratio=1.0)
    state, transfer = fed.round(fed.init())
    after_transfer = jax.device_get(state.groups[0].extra)
    state, collaborate = fed.round(state)
    steps[kind] = (after_transfer, jax.device_get(state.groups[0].extra), transfer, collaborate)
  n = np.asarray(fed.groups[0].train_sizes)
  private = n // 8  # one epoch of the client's rows in batches of 8 (drop_last)
  (mae_t, mae_c, transfer, collaborate), (felo_t, felo_c, *_) = steps['mae'], steps['felo']
  np.testing.assert_array_equal(_adam_steps(mae_t.digest), 0)
  np.testing.assert_array_equal(_adam_steps(mae_t.classifier), private)
  np.testing.assert_array_equal(_adam_steps(felo_t.optimizer), private + 3)  # public stage: 24 // 8
  np.testing.assert_array_equal(_adam_steps(mae_c.digest), 3)
  np.testing.assert_array_equal(_adam_steps(mae_c.classifier), 2 * private)
  np.testing.assert_array_equal(_adam_steps(felo_c.optimizer), 2 * private + 6)
  assert transfer['local_steps'] == collaborate['local_steps'] == int((private + 3).sum())


@pytest.mark.slow
def test_feddf_distils_on_cropped_and_flipped_public_batches(feddf_federation):
  """--feddf_public_augment=crop_flip (FedDF's code's public loader): a distillation step reads its public batch
  cropped and flipped (`augment_batch` from fold_in(fold_in(key, 'DFA'), step)), teacher and student alike: it equals
  the plain step on public rows replaced by those augmented rows by hand, and differs from the plain step."""
  from fedjax_het.data.augment import augment_batch
  from fedjax_het.methods.feddf import distillation_step, server_optimizer
  fed = feddf_federation
  state = fed.init()
  models = [jax.tree.map(lambda a: a[:2], g.params) for g in state.groups]
  stats = [jax.tree.map(lambda a: a[:2], g.model_state) for g in state.groups]
  uploads = tuple(Uploads(GroupState(m, s), jnp.array([True, True]), jnp.ones(2)) for m, s in zip(models, stats))
  public_x, key, batch = jnp.asarray(fed.data.public.x), jax.random.PRNGKey(4), 8
  start = tuple(jax.tree.map(lambda a: a[0], m) for m in models)
  start_states = tuple(jax.tree.map(lambda a: a[0], s) for s in stats)

  def one_step(kind, x):
    cfg = FedDFConfig(server_steps=3, server_batch_size=batch, public_augment=kind)
    opt = server_optimizer(cfg)
    carry = (start, start_states, tuple(opt.init(p) for p in start))
    return distillation_step(cfg, fed.spec, uploads, x, key, batch)(0, carry)[0]

  rows = jax.random.permutation(jax.random.fold_in(key, 0), public_x.shape[0])[:batch]
  by_hand = augment_batch(public_x[rows], jax.random.fold_in(jax.random.fold_in(key, 0x444641), 0), 'crop_flip',
                          fed.spec.training.augment_fill)
  augmented = one_step('crop_flip', public_x)
  tree_allclose(augmented, one_step('none', public_x.at[rows].set(by_hand)), rtol=1e-5, atol=1e-6)
  assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(augmented),
                                                   jax.tree.leaves(one_step('none', public_x))))
