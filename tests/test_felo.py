"""Felo, Velo and FedHe ("Exploiting Features and Logits in Heterogeneous Federated Learning"): hand-computed values
(per-class averaging, the server's per-upload logit mean and per-sample feature mean, the KL term, warm-up, FIFO
eviction, MultiStepLR, the CVAE's shapes, linearity and loss reductions), then a tiny Velo run: Adam states kept across
rounds, one generated feature per class for every client, the traffic counted, vmap == sequential and resume ==
uninterrupted."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tree_allclose
from runs import CFG, record_rounds, run_rounds
from fedjax_het.core import Uploads
from fedjax_het.errors import ConfigError
from fedjax_het.local_training import LocalTraining
from fedjax_het.methods import FeloConfig, VeloConfig, fedhe, felo
from fedjax_het.methods.felo import (FeaturePairs, FeloBroadcast, FeloUpload, empty_store, felo_loss, felo_terms,
                                     logit_upload, multistep_scale, per_class_statistics, push, store_mean,
                                     warmup_rounds, window_mean)
from fedjax_het.methods.shared.common import elementwise_kl
from fedjax_het.methods.velo import FeatureCVAE, cvae_loss, generated_features, init_cvae, train_cvae
from fedjax_het.run.checkpoints import Checkpoints
from fedjax_het.run.experiment import build_federation
from fedjax_het.uploads import RoundUploads


def uploads(values, mask, num_train):
  return Uploads(values, jnp.asarray(mask), jnp.asarray(num_train, jnp.float32))


# ------------------------------------------------------------------ client statistics and loss
def test_per_class_means_of_the_training_steps_with_absent_classes():
  empty, gather = per_class_statistics(3, 2)
  logits = jnp.asarray([[1.0, 2.0, 0.0], [3.0, 4.0, 0.0], [5.0, 6.0, 0.0]])
  stats = gather(empty(), logits, logits[:, :2], jnp.asarray([0, 0, 1]))
  up = logit_upload(stats)
  np.testing.assert_allclose(up.logits[:, :2], [[2.0, 3.0], [5.0, 6.0], [0.0, 0.0]])
  np.testing.assert_allclose(up.logit_counts, [2, 1, 0])
  np.testing.assert_allclose(stats.features[0], [[4.0, 6.0], [5.0, 6.0], [0.0, 0.0]])  # sums, uploaded as such


def test_kl_term_of_the_spec_and_the_codes_reduction():
  kl = elementwise_kl(jnp.zeros((1, 2)), jnp.asarray([[math.log(2.0), 0.0]]))
  np.testing.assert_allclose(2 * kl, 0.058892, atol=1e-6)       # KL(p_s || q) = 0.5 ln(9/8)
  np.testing.assert_allclose(kl, 0.029446, atol=1e-6)           # F.kl_div(reduction='mean'): / (B C)
  masked = elementwise_kl(jnp.zeros((2, 2)), jnp.asarray([[math.log(2.0), 0.0]] * 2), jnp.asarray([True, False]))
  np.testing.assert_allclose(masked, 0.029446 / 2, atol=1e-6)   # the masked row adds 0 and still counts


def test_felo_loss_is_ce_plus_half_mse_plus_kl_and_warmup_is_ce_only():
  logits = jnp.asarray([[math.log(2.0), 0.0]])
  features = jnp.asarray([[1.0, 3.0]])
  labels = jnp.asarray([0])
  broadcast = FeloBroadcast(jnp.zeros((2, 2)), jnp.asarray([True, True]), jnp.asarray([[0.0, 1.0], [9.0, 9.0]]),
                            jnp.asarray([True, True]), distill=jnp.asarray(1.0), lr_scale=jnp.asarray(1.0))
  ce = -math.log(2.0 / 3.0)
  mse = (1.0 + 4.0) / 2                                         # mean over B x d
  np.testing.assert_allclose(felo_loss(logits, features, labels, broadcast, 0.5, True), ce + 0.5 * (mse + 0.029446),
                             rtol=1e-6)
  np.testing.assert_allclose(felo_loss(logits, features, labels, broadcast, 0.5, False), ce + 0.5 * 0.029446,
                             rtol=1e-6)                         # FedHe: no feature term
  warm = broadcast._replace(distill=jnp.asarray(0.0))
  np.testing.assert_allclose(felo_loss(logits, features, labels, warm, 0.5, True), ce, rtol=1e-6)
  absent = broadcast._replace(logit_present=jnp.asarray([False, True]), feature_present=jnp.asarray([False, True]))
  np.testing.assert_allclose(felo_loss(logits, features, labels, absent, 0.5, True), ce, rtol=1e-6)
  # the terms the server logs per round (client_ce, client_alpha_mse, client_alpha_kl)
  np.testing.assert_allclose(felo_terms(logits, features, labels, broadcast, 0.5, True),
                             [ce, 0.5 * mse, 0.5 * 0.029446], rtol=1e-5)


def test_schedules_warmup_rounds_and_multistep_lr():
  assert [warmup_rounds(0.05, r) for r in (400, 100, 10, 20)] == [20, 5, 1, 1]
  assert warmup_rounds(0.0, 10) == 0
  scales = [float(multistep_scale(jnp.asarray(r), 10)) for r in range(10)]
  np.testing.assert_allclose(scales, [1] * 4 + [0.1] * 3 + [0.01] * 3, rtol=1e-6)   # milestones int(4.0), int(7.0)
  with pytest.raises(ConfigError, match=r'^FeloConfig.warmup=1.0 must be in \[0, 1\)'):
    FeloConfig(warmup=1.0)


# ------------------------------------------------------------------ the server's stores
def test_server_logit_mean_is_per_upload_and_feature_mean_is_per_sample():
  alg = felo(FeloConfig(average_models=False), 2, 10, 4)
  server = alg.init_server(jax.random.PRNGKey(0), _spec(2, 2), ())
  values = FeloUpload(jnp.asarray([[[2.0, 3.0], [0.0, 0.0]], [[4.0, 5.0], [0.0, 0.0]]]),
                      jnp.asarray([[1.0, 0.0], [9.0, 0.0]]),
                      FeaturePairs(jnp.asarray([[[2.0, 3.0], [0.0, 0.0]], [[36.0, 45.0], [0.0, 0.0]]]),
                                   jnp.asarray([[1.0, 0.0], [9.0, 0.0]])),
                      loss_terms=jnp.asarray([[2.0, 0.5, 0.1], [4.0, 1.5, 0.3]]))
  new, metrics = alg.phases[0].server_update(server, RoundUploads((uploads(values, [True, True], [1, 9]),)),
                                             jax.random.PRNGKey(0))
  np.testing.assert_allclose([metrics[k] for k in ('client_ce', 'client_alpha_mse', 'client_alpha_kl')],
                             [3.0, 1.0, 0.2], rtol=1e-6)  # the participants' mean, logged per round
  np.testing.assert_allclose(new.logits[0], [3.0, 4.0])      # every client-round counts once
  np.testing.assert_allclose(new.features[0], [3.8, 4.8])    # (2 + 36) / 10, (3 + 45) / 10
  assert new.logit_present.tolist() == [True, False] and new.feature_present.tolist() == [True, False]
  later, _ = alg.phases[0].server_update(new, RoundUploads((uploads(values, [True, False], [1, 9]),)),
                                         jax.random.PRNGKey(0))
  np.testing.assert_allclose(later.logits[0], [(2 + 4 + 2) / 3, (3 + 5 + 3) / 3])   # the store spans rounds
  assert int(later.round) == 2


def test_fifo_the_5001st_feature_evicts_the_oldest():
  store = empty_store(1, 5000, 1)
  store = push(store, jnp.arange(5000.0)[:, None], jnp.zeros(5000, jnp.int32), jnp.ones(5000, bool))
  np.testing.assert_allclose(store_mean(store)[0][0, 0], 2499.5)
  store = push(store, jnp.asarray([[5000.0]]), jnp.zeros(1, jnp.int32), jnp.ones(1, bool))
  np.testing.assert_allclose(store_mean(store)[0][0, 0], 2500.5)           # 1 .. 5000: row 0 evicted
  small = push(empty_store(2, 2, 1), jnp.arange(5.0)[:, None], jnp.asarray([0, 1, 0, 0, 0]),
               jnp.asarray([True, True, True, True, False]))
  np.testing.assert_allclose(store_mean(small)[0][:, 0], [2.5, 1.0])        # the newest two of class 0; invalid out


def test_window_mean_counts_the_newest_features_and_part_of_the_crossing_pair():
  store = push(empty_store(1, 4, 2), jnp.asarray([[10.0, 10.0], [4.0, 2.0]]), jnp.zeros(2, jnp.int32),
               jnp.ones(2, bool))                                          # (sum, count): old (10, 10), new (4, 2)
  means, present = window_mean(store, 6)
  np.testing.assert_allclose(means[0, 0], (4.0 + 0.4 * 10.0) / 6.0)         # newest 2 features + 4 of the old 10
  np.testing.assert_allclose(window_mean(store, 100)[0][0, 0], 14.0 / 12.0)
  assert bool(present[0])


# ------------------------------------------------------------------ Velo's CVAE
def test_velo_cvae_shapes_linearity_and_loss_reductions():
  paper = FeatureCVAE(10, 6)                                               # the code's sizes: 512, 1024, 1024
  shapes = jax.tree.map(jnp.shape, jax.eval_shape(lambda: init_cvae(paper, jax.random.PRNGKey(0)))['params'])
  assert shapes['encoder_in']['kernel'] == (6 + 512, 1024) and shapes['encoder_out']['kernel'] == (1024, 2048)
  assert shapes['decoder_in']['kernel'] == (1024 + 512, 6) and shapes['decoder_out']['kernel'] == (6, 6)
  assert shapes['embed']['embedding'] == (10, 512)
  module = FeatureCVAE(10, 6, 16, 8, 4)
  variables = init_cvae(module, jax.random.PRNGKey(0))
  decode = lambda z, y: module.apply(variables, z, y, method=FeatureCVAE.decode)
  z1, z2 = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 8))
  y = jnp.asarray([0, 3, 9])
  np.testing.assert_allclose(decode(0.3 * z1 + 0.7 * z2, y), 0.3 * decode(z1, y) + 0.7 * decode(z2, y), atol=1e-4)
  mu, logvar = jnp.zeros((2, 4)).at[0, 1].set(1.0), jnp.zeros((2, 4))
  recon, s = jnp.zeros((2, 3)), jnp.asarray([[1.0, 1.0, 1.0], [3.0, 0.0, 0.0]])
  loss, _ = cvae_loss(recon, s, mu, logvar, jnp.ones(2))
  np.testing.assert_allclose(loss, (3.0 + 9.0) / 6 + 0.5, rtol=1e-6)      # mean MSE + summed KL (0.5)
  loss, _ = cvae_loss(recon, s, mu, logvar, jnp.asarray([1.0, 0.0]))
  np.testing.assert_allclose(loss, 1.0 + 0.5, rtol=1e-6)                   # padding rows count nowhere


def test_velo_server_training_starts_a_fresh_adam_and_draws_one_feature_per_class():
  """Each server training is one Adam step here (one batch holds every stored feature). Adam's first step from
  zero moments moves every parameter with a gradient by the rate itself (|m / sqrt(v)| = 1); so does the first step
  of a second training started from the first one's variables, which a carried-over Adam state would not do."""
  cfg = VeloConfig(hidden=8, latent=4, embedding=4, epochs=1, batch_size=12, cvae_learning_rate=1e-3)
  module = FeatureCVAE(3, 5, 8, 4, 4)
  store = push(empty_store(3, 8, 5), jax.random.normal(jax.random.PRNGKey(2), (12, 5)), jnp.arange(12) % 3,
               jnp.ones(12, bool))
  variables = init_cvae(module, jax.random.PRNGKey(0))
  train = jax.jit(train_cvae, static_argnums=(0, 4))
  once, loss = train(module, variables, store, jax.random.PRNGKey(3), cfg)
  twice, _ = train(module, once, store, jax.random.PRNGKey(4), cfg)
  for before, after in ((variables, once), (once, twice)):
    moved = np.concatenate([np.abs(np.ravel(a - b)) for a, b in zip(jax.tree.leaves(after['params']),
                                                                     jax.tree.leaves(before['params']))])
    moved = moved[moved > 1e-6]  # the parameters that had a gradient
    assert moved.size > 100 and moved.max() <= 1.001e-3
    assert np.mean(np.abs(moved - 1e-3) < 1e-5) > 0.95  # all but gradients near Adam's eps
  assert np.isfinite(float(loss))
  features = generated_features(module, once, jax.random.PRNGKey(4))
  assert features.shape == (3, 5)
  assert not np.allclose(features, generated_features(module, once, jax.random.PRNGKey(5)))


# ------------------------------------------------------------------ a tiny Velo run
VELO = VeloConfig(warmup=0.5, feature_store=16, hidden=16, latent=8, embedding=8, upload_rows=24, epochs=1,
                  batch_size=8)
# One architecture group keeps compilation (most of this run's time) small; the server's cross-group means are
# tested above on uploads of several clients.
RUN = dataclasses.replace(CFG, algorithm='velo', models=('mlp',), methods={'velo': VELO})


@pytest.fixture(scope='module')
def fed():
  return build_federation(RUN)


@pytest.fixture(scope='module')
def recorded(fed):
  return record_rounds(fed, fed.init(), 4)


def test_velo_run_warmup_cvae_adam_states_and_traffic(fed, recorded):
  h, states = recorded.history, recorded.states
  assert [m['cvae_trained'] for m in h] == [0.0, 1.0, 1.0, 1.0]            # 2 warm-up rounds; trained after the 2nd
  assert all(np.isfinite(m['train_loss']) for m in h)
  # one generated feature per class, broadcast as the server drew it (one broadcast per group: every client gets
  # it), new each round
  b = fed.algorithm.phases[0].broadcast(states[1].server, fed.groups[0].spec)
  np.testing.assert_array_equal(b.features, states[1].server.features)
  assert b.features.shape == (10, RUN.feature_dim) and b.feature_present.all()
  assert not np.allclose(states[1].server.features, states[2].server.features)
  # each client's Adam state persists: the step counters add up to every round's local steps
  counts = np.concatenate([np.asarray(st.extra.optimizer.count)[:len(g.clients)]
                           for st, g in zip(states[-1].groups, fed.groups)])
  assert counts.sum() == sum(m['local_steps'] for m in h) > counts.max()
  # Velo counts every feature row it sends (d each), the model and C logits per class held
  assert h[0]['upload_features_scalars'] > 0 and h[0]['upload_features_scalars'] % RUN.feature_dim == 0


def test_velo_resume_equals_the_uninterrupted_run(fed, recorded, tmp_path):
  checkpoints = Checkpoints(str(tmp_path / 'ckpt'))
  checkpoints.save(recorded.states[1])
  state, rest = run_rounds(fed, checkpoints.restore(fed.init(), 2), 2)
  tree_allclose(state.groups, recorded.states[-1].groups, rtol=0, atol=0)
  tree_allclose(state.server, recorded.states[-1].server, rtol=0, atol=0)
  assert recorded.history[2:] == rest


def test_fedhe_sends_no_features():
  alg = fedhe(FeloConfig(), 10, 10, 4)
  server = alg.init_server(jax.random.PRNGKey(0), _spec(10, 16), ())
  assert server.channel is None
  up = FeloUpload(jnp.zeros((10, 10)), jnp.ones(10), model={'w': jnp.zeros(7)})
  assert alg.phases[0].traffic.upload(up) == {'logits': 100, 'model': 7}


def test_fedhe_by_default_is_the_papers_logits_only_baseline():
  """The paper's FedHe shares logits only: no weights cross unless --felo_average_models asks for it."""
  from fedjax_het.run.registry import METHODS
  cfg = METHODS['fedhe'].config()
  assert cfg.average_models is False and METHODS['felo'].config().average_models is True
  alg = fedhe(cfg, 10, 10, 4)
  up = FeloUpload(jnp.zeros((10, 10)), jnp.ones(10))
  assert alg.phases[0].traffic.upload(up) == {'logits': 100}
  server = alg.init_server(jax.random.PRNGKey(0), _spec(10, 16), ())
  assert alg.phases[0].traffic.broadcast(alg.phases[-1].broadcast(server, None)).keys() == {'logits'}


def _spec(num_classes, feature_dim):
  from fedjax_het.core import FederationSpec
  return FederationSpec(num_classes, feature_dim, 2, 10, (), None)


def test_the_papers_number_is_the_mean_accuracy_over_the_second_half_of_the_rounds():
  from fedjax_het.run.compare import MethodResult, comparison_table
  from fedjax_het.run.experiment import second_half_mean
  evals = [{'round': 3, 'accuracy': 0.1}, {'round': 6, 'accuracy': 0.3}, {'round': 9, 'accuracy': 0.5}]
  np.testing.assert_allclose(second_half_mean(evals), 0.4)               # rounds 6 and 9 of 9
  summary = lambda a: {'final_accuracy': a, 'best_accuracy': a, 'upload_scalars_per_round': 1,
                       'broadcast_scalars_per_round': 1, 'second_half_mean_accuracy': a}
  table = comparison_table([MethodResult('felo', [summary(0.5), summary(0.7)], [])])
  assert '| felo | 60.00 +- 10.00 |' in table


# ------------------------------------------------------------------ --local_steps (Felo's code: 10 steps per round)
def test_local_steps_keep_the_first_valid_slots_and_cut_one_epoch_plans():
  from fedjax_het.core import ClientProgram, Stage
  from fedjax_het.engine.plan import plan_stages
  plan = lambda epochs, cap: plan_stages(ClientProgram(None, (Stage(None, epochs),), None, LocalTraining(
      batch_size=2, max_steps=cap)), 10)[0]                            # 5 slots per epoch
  assert plan(1, None).valid(6).tolist() == [True, True, True, False, False]  # a client of 6 rows: 3 steps
  assert plan(2, 2).valid(6).tolist() == [True, True] + [False] * 8  # the first 2 of its 6 steps
  assert plan(1, 2).length == 2 and plan(1, 2).valid(6).tolist() == [True, True]  # the scan stops at the cap
  assert plan(2, 2).valid(3).tolist() == [True] + [False] * 4 + [True] + [False] * 4  # one step per epoch
  schedule = plan(1, 2).schedule(jax.random.PRNGKey(0), jnp.asarray(6))
  assert schedule.tolist() == [[0, 1], [2, 3]]                          # stored order, cut to the cap
  assert jnp.asarray(plan(2, 2).valid(jnp.asarray(6))).tolist() == plan(2, 2).valid(6).tolist()  # device == host
  with pytest.raises(ConfigError, match='--local_steps'):
    dataclasses.replace(CFG, local_steps=-1).local_training()


@pytest.mark.parametrize('epochs', [1, 2])
def test_local_steps_cap_each_clients_round_under_both_executors(epochs):
  cfg = dataclasses.replace(CFG, algorithm='fedavg', models=('mlp',), local_steps=3, local_epochs=epochs, rounds=1)
  feds = {s: build_federation(dataclasses.replace(cfg, strategy=s)) for s in ('sequential', 'vmap')}
  runs = {s: record_rounds(f, f.init(), 1) for s, f in feds.items()}
  participants = 2                                                      # join_ratio 0.5 of 4 clients
  sizes = feds['sequential'].train_sizes
  assert runs['sequential'].history[0]['local_steps'] == 3 * participants < (sizes // 16).min() * epochs
  np.testing.assert_allclose(runs['vmap'].history[0]['train_loss'], runs['sequential'].history[0]['train_loss'],
                             rtol=1e-5)
  tree_allclose(runs['vmap'].states[0].groups, runs['sequential'].states[0].groups, rtol=1e-4, atol=1e-6)
