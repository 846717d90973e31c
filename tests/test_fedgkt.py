"""FedGKT: its distillation loss by hand, the per-client broadcast of the server's logits (each client reads its
own rows' logits, kept per client across rounds, none before the server has sent any), what crosses, the server
model's adapters, and the refusal under DP. (vmap == sequential and its pinned numbers: tests/test_golden.py;
resume == uninterrupted: tests/test_seed_baselines.py.)"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_het.core import PerClient, for_client
from fedjax_het.engine.vmap_executor import vmap_broadcast
from fedjax_het.errors import ConfigError
from fedjax_het.methods import FedGKTConfig
from fedjax_het.methods.fedgkt import FedGKTUpload, ServerModel, client_kd_loss
from fedjax_het.run.config import ExperimentConfig
from fedjax_het.run.experiment import build_federation


def test_client_distillation_loss_by_hand():
  # T = 2: student [0, 0] -> p = (1/2, 1/2); teacher [2 ln 3, 0] / T -> q = (3/4, 1/4);
  # T^2 KL(q || p) = 4 (3/4 ln(3/2) + 1/4 ln(1/2)), averaged over the real rows only.
  student = jnp.array([[0.0, 0.0], [5.0, -5.0]])
  teacher = jnp.array([[2 * math.log(3), 0.0], [0.0, 0.0]])
  expected = 4 * (0.75 * math.log(1.5) + 0.25 * math.log(0.5))
  got = client_kd_loss(student, teacher, 2.0, jnp.array([True, False]))
  assert float(got) == pytest.approx(expected, rel=1e-6)
  assert float(client_kd_loss(student[:1], teacher[:1], 2.0)) == pytest.approx(expected, rel=1e-6)


def test_each_client_reads_only_its_own_slice_of_a_per_client_broadcast():
  b = {'model': jnp.array([7.0]), 'own': PerClient({'logits': jnp.array([[1.0], [2.0], [3.0]])})}
  assert float(for_client(b, 2)['own'].values['logits'][0]) == 3.0
  assert float(for_client(b, 2)['model'][0]) == 7.0
  assert for_client({'model': 1}, 0) == {'model': 1}  # nothing per client: the broadcast itself
  # The vmap executor's slots [2, 0, past the group] read clients 2, 0 and (clipped, an empty slot) the last.
  read = vmap_broadcast(lambda x, b: x + b['own'].values['logits'][0] + b['model'][0], b, jnp.array([2, 0, 5]))
  np.testing.assert_allclose(read(jnp.zeros(3)), [10.0, 8.0, 10.0])


def _federation(join_ratio=0.5, **methods):
  cfg = ExperimentConfig(algorithm='fedgkt', dataset='synthetic:8,8,1', data_fraction=0.1, num_clients=4,
                         models=('mlp',), feature_dim=16, rounds=3, batch_size=8, join_ratio=join_ratio,
                         partition='iid',
                         methods={'fedgkt': FedGKTConfig(**{'server_epochs': 1, 'server_blocks': 1, **methods})})
  return build_federation(cfg)


def test_server_logits_go_to_the_clients_that_sent_the_rows_and_are_kept():
  fed = _federation()
  state = fed.init()
  g = fed.groups[0]
  logits0 = np.asarray(state.server.logits[0])
  assert logits0.shape == (4, g.train.x.shape[1], 10) and not np.asarray(state.server.has[0]).any()
  seen = set()
  for r in range(3):
    joined = set(fed.participants(r).tolist())
    before = jax.device_get(state.server)
    state, m = fed.round(state)
    after = jax.device_get(state.server)
    sizes = g.train_sizes
    # What each participant receives: its own rows' logits, once the server has sent it any.
    assert m['broadcast_scalars'] == sum(int(sizes[k]) * 10 for k in joined if k in seen)
    # per row: the mlp extractor's 512 features (before RM), 10 logits, its label
    assert m['upload_scalars'] == sum(int(sizes[k]) * (512 + 10 + 1) for k in joined)
    for k in range(4):
      if k in joined:  # new logits for its real rows, zeros past them
        assert after.has[0][k]
        assert not np.allclose(after.logits[0][k][:sizes[k]], before.logits[0][k][:sizes[k]])
        assert (np.abs(after.logits[0][k][:sizes[k]]).sum(-1) > 0).all()  # every real row has its logits
        np.testing.assert_array_equal(after.logits[0][k][sizes[k]:], 0.0)
      else:  # a client not drawn keeps what it had
        np.testing.assert_array_equal(after.logits[0][k], before.logits[0][k])
        assert after.has[0][k] == before.has[0][k]
    seen |= joined


@pytest.mark.slow
def test_the_distillation_term_waits_for_the_servers_logits():
  # Round 1 trains on CE alone whatever alpha is; from the round a client has logits, alpha changes its loss.
  losses = {}
  for alpha in (0.0, 50.0):
    fed = _federation(join_ratio=1.0, alpha=alpha)
    state = fed.init()
    losses[alpha] = []
    for _ in range(2):
      state, m = fed.round(state)
      losses[alpha].append(m['train_loss'])
  assert losses[0.0][0] == losses[50.0][0]
  assert losses[50.0][1] > losses[0.0][1] + 1e-3


def test_the_server_model_adapts_groups_whose_features_differ_in_width():
  cfg = ExperimentConfig(algorithm='fedgkt', dataset='synthetic:8,8,1', num_clients=4,
                         models=('mlp', 'heterofl_conv@0.125'), feature_dim=16, rounds=1, batch_size=8,
                         methods={'fedgkt': FedGKTConfig(server_blocks=1)})
  fed = build_federation(cfg)
  server = ServerModel(fed.spec, 4, 1)
  channels = [s[-1] for s in server.map_shapes]
  params, _ = server.init(jax.random.PRNGKey(0))
  assert channels[0] != channels[1] and server.width == max(channels)
  assert [p['kernel'].shape if p else None for p in params['adapters']] == [
      (c, max(channels)) if c < max(channels) else None for c in channels]
  same = dataclasses.replace(cfg, models=('mlp',))
  assert ServerModel(build_federation(same).spec, 4, 1).init(jax.random.PRNGKey(0))[0]['adapters'] == ({},)


# FedGKT's code's split: its client ResNet-8 and the cut after the stem.
STEM_SPLIT = ExperimentConfig(algorithm='fedgkt', dataset='synthetic:4,4,3', data_fraction=0.1, num_clients=2,
                              models=('resnet8_gkt',), feature_dim=64, rm='none', rounds=1, batch_size=8,
                              join_ratio=1.0, methods={'fedgkt': FedGKTConfig(server_blocks=1, server_epochs=1,
                                                                              split='stem')})


def test_the_codes_client_cuts_after_its_stem():
  """FedGKT's client ResNet-8 (its resnet8_56): a 16-channel 3x3/1 stem, then two bottlenecks of 16 planes (64 out);
  the code uploads the stem's map, 16 x H x W. Extractor parameters by hand: stem 3*16*9 + BN 32 = 464; the first
  bottleneck 16*16 + 32 + 16*16*9 + 32 + 16*64 + 128 + projection 16*64 + 128 = 4,928; the second 64*16 + 32 +
  2,304 + 32 + 1,024 + 128 = 4,544: 9,936."""
  from fedjax_het.methods.fedgkt import map_shape
  from fedjax_het.models import build_model
  model = build_model('resnet8_gkt', 10, 64, 'none')
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3))))['params']
  assert sum(a.size for a in jax.tree.leaves(params['extractor'])) == 9936
  fed = build_federation(STEM_SPLIT)
  assert map_shape(fed.groups[0].spec, 'stem') == (4, 4, 16) and map_shape(fed.groups[0].spec) == (4, 4, 64)
  with pytest.raises(ConfigError, match="split='stem': this client's architecture has no ResNet stem"):
    build_federation(dataclasses.replace(STEM_SPLIT, dataset='synthetic:4,4,1', models=('mlp',), rm='ap')).init()


@pytest.mark.slow  # a round of the ResNet-8 client and its server model: about 10 s of a 2-core CPU
def test_the_server_trains_on_the_full_resolution_maps_of_the_stem_split():
  """A round of the stem split uploads each client's 16 x H x W stem maps, and the server model trains on them."""
  fed = build_federation(STEM_SPLIT)
  state, row = fed.round(fed.init())
  assert row['upload_features_scalars'] == fed.train_sizes.sum() * 4 * 4 * 16
  assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(state.server.model))


def test_bad_fedgkt_settings_name_their_flags():
  with pytest.raises(ConfigError, match=r"FedGKTConfig.optimizer='rmsprop': choose one of adam, sgd"):
    FedGKTConfig(optimizer='rmsprop')
  with pytest.raises(ConfigError, match='FedGKTConfig.server_epochs=-1 must be >= 0'):
    FedGKTConfig(server_epochs=-1)


# Slow (`-m slow`; about 8 s, FedGKT's server model initialised first): the refusal of an integer upload part that
# is not declared public is checked in the default run by tests/test_dp.py, on a part of its own.
@pytest.mark.slow
def test_fedgkt_is_refused_under_dp():
  cfg = ExperimentConfig(algorithm='fedgkt', dataset='synthetic:8,8,1', num_clients=4, models=('mlp',),
                         feature_dim=16, rounds=1, batch_size=8, dp_mode='central', dp_noise_multiplier=1.0)
  fed = build_federation(cfg)
  with pytest.raises(ConfigError, match="uploads 'y' as int32, which Gaussian noise cannot protect"):
    fed.round(fed.init())


@pytest.mark.slow
def test_a_last_batch_of_one_row_keeps_the_deep_server_finite():
  # 9 rows in batches of 8: the second batch has one real row and seven of padding. Padding normalised by that
  # row's statistics overflowed through the server's BatchNorms (0 * inf = NaN in the masked loss); it must not.
  from fedjax_het.core import Uploads, server_step
  fed = _federation(server_blocks=3, server_distill=True, temperature=1.0)
  state = fed.init()
  n_max = fed.groups[0].train.x.shape[1]
  rows = jnp.zeros((2, n_max), bool).at[0, :9].set(True)
  features = jnp.where(rows[..., None], jax.random.normal(jax.random.PRNGKey(0), (2, n_max, 512)) * 3, 0.0)
  values = FedGKTUpload(features, jax.random.normal(jax.random.PRNGKey(1), (2, n_max, 10)),
                        jnp.zeros((2, n_max), jnp.int32), rows, jnp.zeros(2, bool))
  uploads = (Uploads(values, jnp.array([True, False]), jnp.array([9.0, 0.0]), jnp.array([0, 4])),)
  new, metrics = jax.jit(server_step(fed.algorithm.phases[0], fed.spec))(state.server, uploads, jax.random.PRNGKey(2))
  assert np.isfinite(float(metrics['server_loss']))
  assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(new.model))
  assert np.isfinite(np.asarray(new.logits[0][0, :9])).all() and new.has[0][0] and not new.has[0][1:].any()


def test_the_server_plateau_schedule_is_torchs_reduce_lr_on_plateau():
  """`plateau_step` against torch's ReduceLROnPlateau('max', factor, patience) (the code's server scheduler) on a
  sequence of accuracies that improves, stalls, improves by less than the 1e-4 threshold and stalls again; the scale
  at each step is the torch optimizer's rate over the initial rate."""
  from fedjax_het.methods.fedgkt import plateau_init, plateau_step
  metrics = [0.1, 0.2, 0.2, 0.19, 0.2, 0.20001, 0.3, 0.3, 0.3, 0.3, 0.25, 0.3, 0.3, 0.3, 0.3]
  expected = {}
  try:
    import torch
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, 'max', factor=0.5, patience=2)
    for m in metrics:
      scheduler.step(m)
      expected.setdefault('torch', []).append(opt.param_groups[0]['lr'] / 1e-3)
  except ImportError:
    pass
  # By hand (patience 2: a third step without an improvement of more than 1e-4 relative halves the rate):
  # 0.1 best, 0.2 best, then 0.2 / 0.19 / 0.2 bad (3 > 2: halve), 0.20001 not above 0.2 * 1.0001: bad 1, 0.3 best,
  # 0.3 x 3 bad (halve), 0.25 bad 1, 0.3 bad 2, 0.3 bad 3 (halve), 0.3 bad 1, 0.3 bad 2.
  by_hand = [1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.125, 0.125, 0.125]
  plateau, got = plateau_init(), []
  for m in metrics:
    plateau = plateau_step(plateau, jnp.float32(m), 0.5, 2, 1e-3)
    got.append(float(plateau.scale))
  assert got == by_hand
  if 'torch' in expected:
    np.testing.assert_allclose(got, expected['torch'], rtol=1e-6)


@pytest.mark.slow
def test_the_server_steps_at_its_plateau_scale_and_reports_it():
  """The server's steps are scaled by its plateau's factor (a scale of 0 leaves its parameters where they were), and
  every round's scale and accuracy are reported; with patience 0 a round without a better accuracy halves it."""
  fed = _federation(join_ratio=1.0, plateau_factor=0.5, plateau_patience=0)
  start = jax.device_get(fed.init().server.model)  # a round donates the states it is given: each runs on its own
  frozen = fed.init()
  frozen = frozen._replace(server=frozen.server._replace(plateau=frozen.server.plateau._replace(
      scale=jnp.float32(0.0))))
  after, m = fed.round(frozen)
  for a, b in zip(jax.tree.leaves(after.server.model), jax.tree.leaves(start)):
    np.testing.assert_array_equal(a, b)
  moved, m = fed.round(fed.init())
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(moved.server.model), jax.tree.leaves(start)))
  assert m['server_lr_scale'] == 1.0 and 0.0 <= m['server_train_accuracy'] <= 1.0
  best, scale = m['server_train_accuracy'], 1.0
  for _ in range(2):
    moved, m = fed.round(moved)
    if not m['server_train_accuracy'] > best * (1 + 1e-4):
      scale *= 0.5
    best = max(best, m['server_train_accuracy'])
    assert m['server_lr_scale'] == pytest.approx(scale)


@pytest.mark.slow
def test_the_uploaded_maps_are_extracted_from_augmented_rows():
  """FedGKT's code extracts the uploaded maps through its training loader (crop, flip, Cutout): with --augment each
  row's upload is its extractor's output on the row augmented by fold_in(the final key, row), one draw per row."""
  from fedjax_het.core import ClientRows
  from fedjax_het.data.augment import augment_batch
  from fedjax_het.methods.fedgkt import extract
  results = {}
  for augment in ('none', 'crop_flip'):
    cfg = ExperimentConfig(algorithm='fedgkt', dataset='synthetic:8,8,1', data_fraction=0.1, num_clients=4,
                           models=('mlp',), feature_dim=16, rounds=1, batch_size=8, partition='iid', augment=augment,
                           methods={'fedgkt': FedGKTConfig(server_epochs=1, server_blocks=1)})
    fed = build_federation(cfg)
    state = fed.init()
    g, program = fed.groups[0], fed.programs[0][0]
    client = jax.tree.map(lambda a: a[0], state.groups[0])
    n = int(g.train_sizes[0])
    rows = ClientRows(g.train.x[0], g.train.y[0], jnp.asarray(n), jnp.asarray(n), None)
    key = jax.random.PRNGKey(7)
    _, upload = program.final(client, rows, for_client(fed.broadcast(state.server, 0, 0), 0), key)
    model = g.spec.model
    by_hand = [extract(model, client.params, client.model_state, augment_batch(
        g.train.x[0, r][None], jax.random.fold_in(key, r), augment, g.spec.training.augment_fill))[0][0]
        for r in range(n)]
    np.testing.assert_allclose(upload.features[:n], np.stack(by_hand), rtol=1e-5, atol=1e-5)
    results[augment] = np.asarray(upload.features[:n])
  assert not np.allclose(results['none'], results['crop_flip'])


def test_fedml_normalisations_are_fedgkts_codes():
  """--input_normalization=cifar10_fedml / cinic10_fedml: (x/255 - mean) / std with FedML's loaders' statistics
  (FedGKT's code: CIFAR-10's std (0.2470, 0.2435, 0.2616), not the (0.2023, 0.1994, 0.2010) of other codes), and
  a crop's padding is the raw black pixel under them."""
  from fedjax_het.data.datasets import Dataset, black_pixel
  raw = np.array([0.0, 128.0, 255.0], np.float32)  # one pixel's R, G, B
  ds = Dataset('one', (raw / 255 * 2 - 1).reshape(1, 1, 1, 3), np.zeros(1, np.int32), 2)
  for kind, mean, std in (('cifar10_fedml', (0.49139968, 0.48215827, 0.44653124), (0.24703233, 0.24348505, 0.26158768)),
                          ('cinic10_fedml', (0.47889522, 0.47227842, 0.43047404), (0.24205776, 0.23828046, 0.25874835))):
    expected = (raw / 255 - np.array(mean)) / np.array(std)
    np.testing.assert_allclose(ds.normalized(kind).x[0, 0, 0], expected, rtol=1e-5)
    np.testing.assert_allclose(black_pixel(kind), -np.array(mean) / np.array(std), rtol=1e-6)
