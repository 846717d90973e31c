"""Poisson sampling (--participation=poisson): the draw, the engine's slots and empty rounds, DP's fixed denominator
and its accounting under add/remove adjacency, and what a run under it writes."""

import dataclasses
import os
import types

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import rdp

from fedjax_het.core import Algorithm, Phase, UploadPrivacy, Uploads, server_step
from fedjax_het.engine import ExecutionConfig, Federation, LocalTraining, ModelConfig
from fedjax_het.engine.schedule import Schedule
from fedjax_het.errors import ConfigError
from fedjax_het.privacy.budget import PrivacyBudget, calibrate
from fedjax_het.privacy.dp import DPConfig, claims_amplification, privatize
from fedjax_het.run.config import ExperimentConfig
from fedjax_het.run.experiment import make_algorithm, private_algorithm, train_and_evaluate
from fedjax_het.uploads import concat_groups
from fedjax_het.uploads import participant_average

from golden import TINY, tiny_data
from runs import CFG, metric_rows

PHASE = (Phase('p', None, None),)


def poisson(num_clients=400, rounds=200, rate=0.25, full=0, seed=0):
  return Schedule('test', PHASE, num_clients, rounds, rate, full, seed, participation='poisson')


# ---------------------------------------------------------------- the draw
def test_each_client_joins_each_round_independently_with_probability_q():
  """N = 400, q = 0.25, 200 rounds: each client's share of rounds ~ q, the round's count varies as a binomial's
  (variance Nq(1 - q) = 75; a fixed-size draw has none), the last rounds take everyone, and the draw is the seed's."""
  s = poisson(full=5)
  joined = np.zeros((195, 400), bool)
  for r in range(195):
    joined[r, s.participants(r)] = True
  assert joined.mean() == pytest.approx(0.25, abs=0.005)
  assert np.var(joined.sum(1)) == pytest.approx(75, rel=0.25)
  assert abs(np.corrcoef(joined[:, 0], joined[:, 1])[0, 1]) < 0.2  # independent clients
  assert all(len(s.participants(r)) == 400 for r in range(195, 200))
  assert s.num_join(3) == len(s.participants(3)) and s.expected_count(3) == 100 and s.expected_count(199) == 400
  assert np.array_equal(s.participants(7), poisson(full=5).participants(7))
  assert not np.array_equal(s.participants(7), poisson(full=5, seed=1).participants(7))
  with pytest.raises(ConfigError, match='--participation=.uniform. must be one of fixed, poisson'):
    Schedule('test', PHASE, 4, 2, 0.5, participation='uniform')


# ---------------------------------------------------------------- the engine
def federation(participation='poisson', join_ratio=0.25, num_clients=16, algorithm='fedavg', dp=None):
  from fedjax_het.data import make_federated_data, make_synthetic
  data = make_federated_data(make_synthetic(num_samples=640, image_shape=(8, 8, 1), num_classes=4, noise=0.3, seed=1),
                             num_clients=num_clients, partition='dirichlet', seed=3, alpha=0.5)
  cfg = ExperimentConfig(algorithm=algorithm, **{**TINY, 'rounds': 3, 'feature_dim': 16})
  method = make_algorithm(cfg, data)
  if dp is not None:
    method = privatize(method, dp)
  return Federation(method, data, ModelConfig(('mlp',), 16), LocalTraining(0.05, 8, 1),
                    ExecutionConfig(strategy='vmap', eval_batch_size=16), join_ratio=join_ratio, rounds=3,
                    participation=participation)


def leaves(tree):
  return [np.asarray(a) for a in jax.tree.leaves(tree)]


def test_slots_fit_the_draw_and_padding_them_to_the_whole_group_changes_nothing():
  """16 clients in one group at q = 0.25: slots for the expected 4 plus four standard deviations (12), not 16; the
  same rounds with every slot of the group give the same states and metrics."""
  bucketed, whole = federation(), federation()
  whole.slots = lambda r: [g.size for g in whole.groups]
  assert bucketed.slots(0) == [12] and whole.slots(0) == [16]
  a, b = bucketed.init(), whole.init()
  for _ in range(3):
    a, row_a = bucketed.round(a)
    b, row_b = whole.round(b)
    assert {k: v for k, v in row_a.items() if 'seconds' not in k} == pytest.approx(
        {k: v for k, v in row_b.items() if 'seconds' not in k})
  assert row_a['sampling_rate'] == 0.25
  for x, y in zip(leaves(a), leaves(b)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_a_round_that_draws_nobody_leaves_the_server_as_it_was_and_the_run_goes_on(tmp_path):
  """FedTGP's server trains its prototypes on what it received: with nobody drawn it has nothing, and its state
  stays (its step on an empty round would move them)."""
  fed = federation(join_ratio=0.05, num_clients=4, algorithm='fedtgp')
  empty = next(r for r in range(20) if not len(fed.participants(r)))
  state = fed.init()
  state = state._replace(round=jnp.asarray(empty, jnp.int32))
  new, row = fed.round(state)
  assert int(new.round) == empty + 1 and row['participants'] == 0 and 'train_loss' not in row
  assert row['upload_scalars'] == 0 and row['local_steps'] == 0
  for x, y in zip(leaves(state.server), leaves(new.server)):
    np.testing.assert_array_equal(x, y)
  cfg = dataclasses.replace(CFG, participation='poisson', join_ratio=0.1, rounds=3)
  assert not all(len(Schedule('fedavg', PHASE, 4, 3, 0.1, seed=cfg.seed, participation='poisson').participants(r))
                 for r in range(3))
  summary = train_and_evaluate(cfg, str(tmp_path / 'run'), progress=False)
  assert summary['rounds'] == 3 and [r['sampling_rate'] for r in metric_rows(tmp_path / 'run')] == [0.1] * 3


# ---------------------------------------------------------------- DP: the fixed denominator
REFERENCE = {'model': jnp.asarray([1.0, -2.0, 0.5])}
DECLARED = UploadPrivacy(reference=lambda b: {'model': b['model']}, aggregate='sum', hides_participants=True)


def averaging_method() -> Algorithm:
  """A server that averages the participants' models, unweighted (LG-FedAvg's and FML's step)."""
  def step(server, uploads, key):
    u = concat_groups(uploads)
    return {'model': participant_average(u.values['model'], u.num_train, server['model'])}, {}
  return Algorithm(name='averaging', init_server=None, phases=(Phase('p', None, step),), evaluation=None,
                   upload_privacy=DECLARED)


def server_after(deltas: list, slots=(3, 2), expected=6.0, sigma=1e-12, clip=10.0, key=0, keys=None):
  """The averaging server's model after a round whose participants upload REFERENCE + deltas, laid out over groups
  of `slots`, under central DP with the fixed denominator; given `keys` (a count), one model per key 0, 1, ...
  stacked, from one vmapped call."""
  private = privatize(averaging_method(), DPConfig('central', clip, sigma, fixed_denominator=True))
  phase = private.phases[0]
  assert phase.server_of_spec and phase.runs_without_participants
  uploads, at = [], 0
  for s in slots:
    rows = [REFERENCE['model'] + jnp.asarray(d) for d in deltas[at:at + s]]
    real = len(rows)
    rows += [jnp.zeros(3)] * (s - real)
    mask = jnp.arange(s) < real
    uploads.append(Uploads({'model': jnp.stack(rows)}, mask, mask.astype(jnp.float32) * 50, jnp.arange(s),
                           jnp.full(s, expected)))
    at += real
  spec = types.SimpleNamespace(groups=(None,))
  step = lambda k: server_step(phase, spec)(dict(REFERENCE), tuple(uploads), jax.random.PRNGKey(k))[0]['model']
  return np.asarray(step(key) if keys is None else jax.jit(jax.vmap(step))(jnp.arange(keys)))


def test_under_poisson_sampling_the_mean_divides_by_the_expected_count_by_hand():
  """Three participants with deltas (1, 0, 0), (0, 2, 0), (0, 0, 3) (all within C = 10), E = qN = 6: the model is
  r + (1, 2, 3) / 6, not r + (1, 2, 3) / 3; a fourth participant who contributes nothing changes nothing (the mean
  over 4 would be r + (1, 2, 3) / 4)."""
  deltas = [[1, 0, 0], [0, 2, 0], [0, 0, 3]]
  expected = np.asarray([1.0, -2.0, 0.5]) + np.asarray([1, 2, 3]) / 6
  np.testing.assert_allclose(server_after(deltas), expected, atol=1e-6)
  np.testing.assert_allclose(server_after(deltas + [[0, 0, 0]]), expected, atol=1e-6)
  np.testing.assert_allclose(server_after(deltas[:2] + [[0, 0, 0], [0, 0, 3]]), expected, atol=1e-6)


def test_a_round_that_drew_nobody_releases_the_noise_alone():
  """No participant: the model is r + Z / E with Z ~ N(0, sigma^2 C^2): sigma = 2, C = 1.5, E = 6 gives a standard
  deviation of 0.5 in each coordinate, over 400 rounds' keys; a server that skipped such a round would release r."""
  draws = server_after([], sigma=2.0, clip=1.5, keys=400) - np.asarray(REFERENCE['model'])
  assert draws.std() == pytest.approx(0.5, rel=0.08) and abs(draws.mean()) < 0.05


def test_only_a_mean_over_all_participants_claims_amplification_under_poisson():
  from golden import make_golden_federation
  declared = {n: make_golden_federation(n).algorithm.upload_privacy for n in ('lg_fedavg', 'fml', 'fedmd', 'fedre',
                                                                               'fedproto')}
  assert [claims_amplification(declared[n], declared[n].public, 'poisson') for n in declared] == [
      True, True, True, False, False]
  assert claims_amplification(declared['fedre'], ('label', 'weight'), 'fixed')  # a fixed-size draw still may
  with pytest.raises(ConfigError, match='DPConfig.fixed_denominator: fedre'):
    privatize(make_golden_federation('fedre').algorithm,
              DPConfig('central', 1.0, 1.0, parts=('label', 'weight'), fixed_denominator=True))


# ---------------------------------------------------------------- DP: the accounting
def test_an_amplified_poisson_run_is_the_poisson_subsampled_gaussian_under_add_remove():
  """q = 0.25, sigma = 1.5, 30 rounds, the last 5 with every client: dp-accounting's RDP of 25 Poisson-subsampled
  Gaussians of multiplier sigma (sensitivity C: add/remove) and 5 plain ones; no realised-draw bound."""
  s = poisson(num_clients=20, rounds=30, full=5)
  budget = PrivacyBudget(s, 'central', 1.5, 1e-5)
  acc = rdp.RdpAccountant()  # add/remove is its default
  acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
      0.25, dp_accounting.GaussianDpEvent(1.5)), 25))
  acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(1.5), 5))
  assert budget.epsilon(30) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
  assert budget.hides_count and budget.describe()['adjacency'].startswith('add or remove one client')
  assert budget.describe()['sampling'].startswith('Poisson')
  pld = dataclasses.replace(budget, accountant='pld')  # dp-accounting's PLD bounds Poisson sampling
  assert pld.epsilon(30) == pytest.approx(acc.get_epsilon(1e-5), rel=0.1)
  sigma = calibrate(budget, 3.0)
  assert dataclasses.replace(budget, noise_multiplier=sigma).epsilon(30) == pytest.approx(3.0, rel=1e-3)


def test_every_client_every_round_is_one_gaussian_of_sigma_over_root_t_by_hand():
  """q = 1 for all 16 rounds, sigma = 8: add/remove sensitivity C, so the 16 rounds are one Gaussian of multiplier
  8 / 4 = 2, whose exact epsilon at delta 1e-5 is dp-accounting's analytic figure (the replace-one accounting of a
  fixed-size draw, sensitivity 2C, gives that of multiplier 1, larger)."""
  budget = PrivacyBudget(poisson(num_clients=20, rounds=16, rate=1.0), 'central', 8.0, 1e-5, accountant='pld')
  assert budget.epsilon(16) == pytest.approx(dp_accounting.get_epsilon_gaussian(2.0, 1e-5), rel=1e-3)
  fixed = PrivacyBudget(Schedule('test', PHASE, 20, 16, 1.0), 'central', 8.0, 1e-5, accountant='pld')
  assert fixed.epsilon(16) == pytest.approx(dp_accounting.get_epsilon_gaussian(1.0, 1e-5), rel=1e-3)


def test_a_resumed_poisson_run_accounts_the_rates_that_ran():
  """Ten rounds, the last five at q = 1; resumed to twenty: rounds 6-10 ran at q = 1, whatever the new schedule."""
  ran = PrivacyBudget(poisson(num_clients=20, rounds=10, full=5), 'central', 4.0, 1e-5)
  longer = PrivacyBudget(poisson(num_clients=20, rounds=20, full=5), 'central', 4.0, 1e-5)
  resumed = longer.after([{'sampling_rate': q} for q in [0.25] * 5 + [1.0] * 5])
  assert resumed.epsilon(10) == pytest.approx(ran.epsilon(10), rel=1e-12) and ran.epsilon(10) > longer.epsilon(10)
  assert resumed.draws(12) == [(0.25, 5), (1.0, 5), (0.25, 2)]


# ---------------------------------------------------------------- DP runs
def test_an_amplified_poisson_run_writes_nothing_that_counts_the_draw_and_resumes_exactly(tmp_path):
  cfg = dataclasses.replace(CFG, algorithm='lg_fedavg', participation='poisson', rounds=4, dp_mode='central',
                            dp_noise_multiplier=2.0, dp_reproducible_noise=True)
  full = train_and_evaluate(cfg, str(tmp_path / 'full'), progress=False)
  rows = metric_rows(tmp_path / 'full')
  assert not [k for r in rows for k in r if k == 'participants' or k.startswith(('upload_', 'broadcast_'))]
  assert full['dp']['adjacency'].startswith('add or remove') and full['upload_scalars_total'] is None
  train_and_evaluate(dataclasses.replace(cfg, rounds=2), str(tmp_path / 'cut'), progress=False)
  resumed = train_and_evaluate(cfg, str(tmp_path / 'cut'), resume=True, progress=False)
  assert metric_rows(tmp_path / 'cut') == rows and resumed['dp'] == full['dp']
  plain = dataclasses.replace(cfg, algorithm='fedavg')  # a per-group mean: the draw is public, counts written
  algorithm, budget = private_algorithm(plain, make_algorithm(plain, tiny_data()), 6)
  assert not budget.sampled and not budget.hides_count
  assert budget.describe()['adjacency'].startswith('replace-one')


def test_a_dp_server_dividing_by_an_expected_count_below_one_is_refused_and_empty_rounds_warned_of(tmp_path,
                                                                                                  caplog):
  """--join_ratio=1e-9 under central DP divided every noised mean by q N = 4e-9 (the noise x2.5e8): the model was
  wrecked and the run said finished. Refused before anything runs, naming the flags; at q N = 1 it runs. Where nothing
  divides by q N (no DP, or local DP) the run goes on with a warning that most rounds draw nobody."""
  from fedjax_het.run.experiment import build_federation
  cfg = dataclasses.replace(CFG, algorithm='lg_fedavg', participation='poisson', join_ratio=1e-9, dp_mode='central',
                            dp_noise_multiplier=1.0)
  with pytest.raises(ConfigError, match=r'^--participation=poisson --join_ratio=1e-09 with --num_clients=4: a round '
                                        r'expects q x N = 4e-09 clients, and under --dp_mode=central lg_fedavg\'s '
                                        r'server divides each noised sum by that expected count .* multiplies the '
                                        r'noise 2\.5e\+08-fold\. Fix: --join_ratio of at least 0\.25 \(1 / '
                                        r'--num_clients\), more --num_clients, or --participation=fixed\.$'):
    train_and_evaluate(cfg, str(tmp_path / 'run'), progress=False)
  assert not {'config.json', 'metrics.jsonl', 'checkpoints'} & set(os.listdir(tmp_path / 'run'))
  assert build_federation(dataclasses.replace(cfg, join_ratio=0.25)).schedule.expected_count() == 1.0
  for other in (dict(dp_mode='local'), dict(dp_mode='off', dp_noise_multiplier=0.0)):
    caplog.clear()
    build_federation(dataclasses.replace(cfg, **other))
    assert 'a round expects 4e-09 clients, so most rounds draw nobody and train nothing' in caplog.text
