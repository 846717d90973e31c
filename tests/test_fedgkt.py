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
from fedjax_het.engine.executors import vmap_broadcast
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


def test_the_codes_client_cuts_after_its_stem_and_the_server_trains_on_full_resolution_maps():
  """FedGKT's client ResNet-8 (its resnet8_56): a 16-channel 3x3/1 stem, then two bottlenecks of 16 planes (64 out);
  the code uploads the stem's map, 16 x H x W. Extractor parameters by hand: stem 3*16*9 + BN 32 = 464; the first
  bottleneck 16*16 + 32 + 16*16*9 + 32 + 16*64 + 128 + projection 16*64 + 128 = 4,928; the second 64*16 + 32 +
  2,304 + 32 + 1,024 + 128 = 4,544: 9,936."""
  from fedjax_het.methods.fedgkt import map_shape
  from fedjax_het.models import build_model
  model = build_model('resnet8_gkt', 10, 64, 'none')
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3))))['params']
  assert sum(a.size for a in jax.tree.leaves(params['extractor'])) == 9936
  cfg = ExperimentConfig(algorithm='fedgkt', dataset='synthetic:4,4,3', data_fraction=0.1, num_clients=2,
                         models=('resnet8_gkt',), feature_dim=64, rm='none', rounds=1, batch_size=8, join_ratio=1.0,
                         methods={'fedgkt': FedGKTConfig(server_blocks=1, server_epochs=1, split='stem')})
  fed = build_federation(cfg)
  assert map_shape(fed.groups[0].spec, 'stem') == (4, 4, 16) and map_shape(fed.groups[0].spec) == (4, 4, 64)
  state, row = fed.round(fed.init())
  assert row['upload_features_scalars'] == fed.train_sizes.sum() * 4 * 4 * 16
  assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(state.server.model))
  with pytest.raises(ConfigError, match="split='stem': this client's architecture has no ResNet stem"):
    build_federation(dataclasses.replace(cfg, dataset='synthetic:4,4,1', models=('mlp',), rm='ap')).init()


def test_fedgkt_is_refused_under_dp_and_bad_settings_name_their_flags():
  cfg = ExperimentConfig(algorithm='fedgkt', dataset='synthetic:8,8,1', num_clients=4, models=('mlp',),
                         feature_dim=16, rounds=1, batch_size=8, dp_mode='central', dp_noise_multiplier=1.0)
  fed = build_federation(cfg)
  with pytest.raises(ConfigError, match="uploads 'y' as int32, which Gaussian noise cannot protect"):
    fed.round(fed.init())
  with pytest.raises(ConfigError, match=r"FedGKTConfig.optimizer='rmsprop': choose one of adam, sgd"):
    FedGKTConfig(optimizer='rmsprop')
  with pytest.raises(ConfigError, match='FedGKTConfig.server_epochs=-1 must be >= 0'):
    FedGKTConfig(server_epochs=-1)


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
