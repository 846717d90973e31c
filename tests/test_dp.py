"""Client-level differential privacy of the uploads (fedjax_het.privacy.dp, fedjax_het.privacy.budget): clipping,
noise, accounting against dp-accounting's own figures, calibration, and DP runs (vmap == sequential, resume)."""

import dataclasses
import json
import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import pld, rdp

from fedjax_het.core import Algorithm, ClientProgram, Phase, UploadPrivacy, Uploads, single_stage
from fedjax_het.engine import ExecutionConfig, Federation, LocalTraining, ModelConfig
from fedjax_het.engine.schedule import Schedule
from fedjax_het.errors import ConfigError
from fedjax_het.methods.fedre import FedREUpload
from fedjax_het.methods.shared.common import class_means_privacy
from fedjax_het.privacy.budget import PrivacyBudget, calibrate
from fedjax_het.privacy.dp import DPConfig, central_noise, privatize, privatize_upload
from fedjax_het.run.compare import MethodResult
from fedjax_het.run.config import ExperimentConfig
from fedjax_het.run.experiment import make_algorithm, private_algorithm, resumable_fields, train_and_evaluate
from fedjax_het.run.registry import Run
from fedjax_het.run.tradeoff import TradeoffPoint, run_tradeoff, write_tradeoff

from golden import TINY, tiny_data
from runs import CFG, metric_rows

KEY = jax.random.PRNGKey(0)


def schedule(num_clients=20, rounds=50, join_ratio=0.25):
  return Schedule('test', (Phase('p', None, None),), num_clients, rounds, join_ratio)


# ---------------------------------------------------------------- clipping and noise
def test_a_contribution_is_clipped_to_c_as_one_vector_or_per_part():
  dp = DPConfig('central', clip=1.0, noise_multiplier=1.0)
  counts = jnp.array([5., 2.])
  out = privatize_upload({'protos': jnp.array([[3., 0.], [0., 4.]]), 'counts': counts}, None,
                         UploadPrivacy(public=('counts',)), dp, KEY, 'test')
  np.testing.assert_allclose(out['protos'], [[0.6, 0.], [0., 0.8]], rtol=1e-6)  # norm 5 -> 1
  np.testing.assert_array_equal(out['counts'], counts)  # public: as it was
  small = privatize_upload({'rep': jnp.array([0.3, 0.4])}, None, UploadPrivacy(), dp, KEY, 'test')
  np.testing.assert_allclose(small['rep'], [0.3, 0.4], rtol=1e-6)  # within C: unchanged
  # each part to C / sqrt(2) = 1: (3, 4) -> (0.6, 0.8); (0.1, 0) is within its bound
  each = privatize_upload({'a': jnp.array([3., 4.]), 'b': jnp.array([0.1, 0.])}, None, UploadPrivacy(),
                          dataclasses.replace(dp, clip=math.sqrt(2), clip_parts='each'), KEY, 'test')
  np.testing.assert_allclose(each['a'], [0.6, 0.8], rtol=1e-6)
  np.testing.assert_allclose(each['b'], [0.1, 0.], rtol=1e-6)
  # a model part: its delta from the broadcast (1, 1) is clipped: (4, 5) - (1, 1) = (3, 4) -> (0.6, 0.8)
  model = privatize_upload({'model': {'w': jnp.array([4., 5.])}}, {'model': {'w': jnp.ones(2)}},
                           UploadPrivacy(reference=lambda b: {'model': b['model']}), dp, KEY, 'test')
  np.testing.assert_allclose(model['model']['w'], [1.6, 1.8], rtol=1e-6)
  for scale in (1e-3, 0.7, 1.0, 30.0, 1e4):  # never above C, whatever the size
    tree = {'x': scale * jax.random.normal(jax.random.PRNGKey(int(scale * 10)), (7, 3)), 'y': jnp.full(4, scale)}
    out = privatize_upload(tree, None, UploadPrivacy(), dp, KEY, 'test')
    assert float(optax_norm(out)) <= 1.0 + 1e-6


def optax_norm(tree):
  return jnp.sqrt(sum(jnp.sum(a ** 2) for a in jax.tree.leaves(tree)))


def test_local_noise_has_standard_deviation_sigma_c():
  """sigma = 2, C = 0.5: N(0, 1) on each of 40,000 entries; the sample std of 40,000 draws is within 0.01 of the
  true one with probability > 0.99 (its own std is 1 / sqrt(80,000) = 0.0035); the seed is fixed."""
  out = privatize_upload({'rep': jnp.zeros((1, 40_000))}, None, UploadPrivacy(),
                         DPConfig('local', clip=0.5, noise_multiplier=2.0), KEY, 'test')
  assert abs(float(jnp.std(out['rep'])) - 1.0) < 0.01 and abs(float(jnp.mean(out['rep']))) < 0.02
  # central mode leaves the client's upload un-noised (the server adds its noise)
  quiet = privatize_upload({'rep': jnp.zeros((1, 100))}, None, UploadPrivacy(),
                           DPConfig('central', clip=0.5, noise_multiplier=2.0), KEY, 'test')
  assert float(jnp.abs(quiet['rep']).max()) == 0.0


def group_uploads(slots_real, held, d=20_000):
  """Zero prototypes of 2 classes for groups of slots; held[g][s] = the classes slot s holds."""
  out = []
  for real, classes in zip(slots_real, held):
    counts = jnp.asarray([[float(c in cs) for c in range(2)] for cs in classes])
    out.append(Uploads({'protos': jnp.zeros((len(real), 2, d)), 'counts': counts}, jnp.asarray(real),
                       jnp.ones(len(real))))
  return tuple(out)


def test_central_noise_is_added_once_to_each_sum_in_shares_of_its_holders():
  """sigma = 2, C = 0.5 (std 1). Class 0 is held by three participants in two groups, class 1 by one: the noise
  on class 0's sum over its holders has std 1, each holder's share 1 / sqrt(3); class 1's one holder carries all
  of it; a non-holder and an empty slot carry none."""
  dp = DPConfig('central', clip=0.5, noise_multiplier=2.0)
  uploads = group_uploads([[True, True, False], [True]], [[{0, 1}, {0}, {0, 1}], [{0}]])
  out = central_noise(uploads, class_means_privacy('protos'), dp, KEY, 'test')
  a, b = out[0].values['protos'], out[1].values['protos']
  total = a[0, 0] + a[1, 0] + b[0, 0]
  assert abs(float(jnp.std(total)) - 1.0) < 0.02
  for share in (a[0, 0], a[1, 0], b[0, 0]):
    assert abs(float(jnp.std(share)) - 1 / math.sqrt(3)) < 0.015
  assert abs(float(jnp.std(a[0, 1])) - 1.0) < 0.02  # the one holder of class 1
  assert float(jnp.abs(a[1, 1]).max()) == 0.0 and float(jnp.abs(a[2]).max()) == 0.0 and float(
      jnp.abs(b[0, 1]).max()) == 0.0
  np.testing.assert_array_equal(out[0].values['counts'], uploads[0].values['counts'])
  # within each group ('group_sum'): group 0's two participants share its sum's noise, group 1's one has it all
  own = central_noise(uploads, UploadPrivacy(public=('counts',), aggregate='group_sum'), dp, KEY, 'test')
  assert abs(float(jnp.std(own[0].values['protos'][0])) - 1 / math.sqrt(2)) < 0.015
  assert abs(float(jnp.std(own[1].values['protos'][0])) - 1.0) < 0.02
  # records: every participant's upload carries std 1
  each = central_noise(uploads, UploadPrivacy(public=('counts',)), dp, KEY, 'test')
  assert abs(float(jnp.std(each[0].values['protos'][1])) - 1.0) < 0.02


def test_the_private_method_clips_in_its_clients_and_its_server_sees_equal_weights_and_the_noise():
  """A method whose client uploads (3, 4) as its model delta from (1, 1) and whose server step returns what it
  receives: under central DP the client sends (1.6, 1.8); the server step gets weight 1 per participant (not the
  sample counts) and the group's sum noised."""
  def final(carry, rows, broadcast, key):
    return carry, {'model': jnp.array([4., 5.]) + 0 * broadcast['model']}
  program = ClientProgram(lambda c, b, k: c, single_stage(lambda c, b, bc, k: (c, 0.0), LocalTraining(0.1, 1, 1)),
                          final, LocalTraining(0.1, 1, 1))
  method = Algorithm('echo', None, (Phase('p', lambda g: program, lambda s, u, k: (u, {})),), None,
                     upload_privacy=UploadPrivacy(reference=lambda b: {'model': b['model']}, aggregate='group_sum'))
  private = privatize(method, DPConfig('central', clip=1.0, noise_multiplier=3.0))
  _, sent = private.phases[0].client(None).final(None, None, {'model': jnp.ones(2)}, KEY)
  np.testing.assert_allclose(sent['model'], [1.6, 1.8], rtol=1e-6)
  values = {'model': jnp.zeros((3, 10_000))}
  got, _ = private.phases[0].server_update({}, (Uploads(values, jnp.array([True, True, False]),
                                                        jnp.array([30., 10., 0.])),), KEY)
  np.testing.assert_array_equal(got[0].num_train, [1., 1., 0.])
  noise = got[0].values['model']
  assert abs(float(jnp.std(noise[0] + noise[1])) - 3.0) < 0.1 and float(jnp.abs(noise[2]).max()) == 0.0


# ---------------------------------------------------------------- accounting
def test_epsilon_is_dp_accountings_figure_for_a_hand_chosen_run():
  """N = 20 clients, 5 drawn per round without replacement, sigma = 2 (multiplier 1 against the replace-one
  sensitivity 2C), T = 50 rounds, delta = 1e-5."""
  budget = PrivacyBudget(schedule(), 'central', 2.0, 1e-5)
  acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
  acc.compose(dp_accounting.SelfComposedDpEvent(
      dp_accounting.SampledWithoutReplacementDpEvent(20, 5, dp_accounting.GaussianDpEvent(1.0)), 50))
  assert budget.epsilon(50) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
  assert 0 == budget.epsilon(0) < budget.epsilon(1) < budget.epsilon(10) < budget.epsilon(50)
  # local mode: the server sees who sent what; the client that joined most often (counted here from the draws)
  # composes that many Gaussians of multiplier 1, which PLD accounts
  counts = np.zeros(20, int)
  for r in range(50):
    counts[schedule().participants(r)] += 1
  local = PrivacyBudget(schedule(), 'local', 2.0, 1e-5, 'pld')
  acc = pld.PLDAccountant()
  acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(1.0), int(counts.max())))
  assert local.epsilon(50) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-3)
  assert local.epsilon(50) > budget.epsilon(50)  # no amplification by sampling
  # central, for a method whose releases show who took part (a per-group or per-class mean): no amplification
  # either, the same figure as local mode
  shown = PrivacyBudget(schedule(), 'central', 2.0, 1e-5, 'pld', hides_participants=False)
  assert shown.epsilon(50) == local.epsilon(50)


def test_a_runs_epsilon_after_round_r_draws_r_rounds_not_the_runs_length():
  """--rounds=100000000 with sampled local DP once drew every round's participants before round 1 (minutes, no
  progress, SIGTERM unanswered); each round's epsilon now draws as far as that round."""
  long = PrivacyBudget(schedule(rounds=10**8, join_ratio=0.5), 'local', 2.0, 1e-5, 'pld')
  short = PrivacyBudget(schedule(rounds=3, join_ratio=0.5), 'local', 2.0, 1e-5, 'pld')
  assert long.epsilon(3) == short.epsilon(3) > 0
  assert len(long._joins['most']) == 4  # rounds 0..3 drawn, not 10**8
  # The stretches of one sample size, by hand: 10 rounds of 5 of 20 clients, then 5 rounds of all 20.
  tail = PrivacyBudget(dataclasses.replace(schedule(rounds=15), full_participation_rounds=5), 'central', 2.0, 1e-5)
  assert tail.draws(15) == [(5, 10), (20, 5)] and tail.draws(12) == [(5, 10), (20, 2)]
  assert tail.draws(4) == [(5, 4)] and long.draws(10**8) == [(10, 10**8)]


@pytest.mark.parametrize('curve, target, answer', [
    (lambda sigma: 27.0 / sigma ** 1.7, 5.0, (27.0 / 5.0) ** (1 / 1.7)),  # a power of sigma, as RDP's nearly is
    (lambda sigma: math.inf if sigma < 2.1 else 5.0 / (sigma - 1.2), 4.0, 2.45),  # infinite below 2.1
    (lambda sigma: math.exp(math.exp(4.0 / sigma)), 20.0, 4.0 / math.log(math.log(20.0)))])  # far from a power
def test_the_amplified_calibration_closes_its_bracket_on_the_answer_in_few_evaluations(curve, target, answer):
  """A falling epsilon(sigma) bracketed by sigma 2 and 4: the sigma returned is at most 1 + 1e-4 times the answer
  and spends at most the target, after at most 8 evaluations (bisection takes 15: both ends, then 13 halvings of
  a ratio of 2 down to 1.0001; the line through the ends, one end kept, 17 on the third curve). 5 / (sigma - 1.2) = 4
  at sigma 1.2 + 5 / 4; exp(exp(4 / sigma)) = 20 at sigma 4 / ln(ln 20) = 3.6457."""
  from fedjax_het.privacy.budget import _narrow_bracket
  tried = []
  sigma = _narrow_bracket(lambda s: tried.append(s) or curve(s), target, 2.0, 4.0, 1e-4)
  assert answer <= sigma <= answer * (1 + 1e-4) and curve(sigma) <= target
  assert len(tried) <= 8, tried
  with pytest.raises(ArithmeticError):  # an accountant's NaN is no side of the target (calibrate names the flag)
    _narrow_bracket(lambda s: math.nan if s > 3.0 else curve(s), target, 2.0, 4.0, 1e-4)


def test_calibration_reaches_the_target_epsilon():
  # A run amplified by its draw calibrates by narrowing a bracket, checked (seconds of RDP evaluations) in
  # test_an_amplified_run_reports_the_bound_that_does_not_depend_on_the_draw_and_calibrates_on_it.
  for budget in (PrivacyBudget(schedule(rounds=20, join_ratio=0.5), 'local', 1.0, 1e-5, 'pld'),
                 PrivacyBudget(schedule(rounds=20, join_ratio=1.0), 'central', 1.0, 1e-5, 'rdp')):
    sigma = calibrate(budget, 3.0)
    assert dataclasses.replace(budget, noise_multiplier=sigma).epsilon(20) == pytest.approx(3.0, rel=1e-3)
    assert dataclasses.replace(budget, noise_multiplier=0.99 * sigma).epsilon(20) > 3.0
  # Targets no noise reaches, and a run without rounds: one error naming the flag, not the accountant's.
  for budget, target in ((PrivacyBudget(schedule(rounds=20), 'central', 1.0, 1e-5), 1e300),
                         (PrivacyBudget(schedule(rounds=20, join_ratio=0.5), 'local', 1.0, 1e-5, 'pld'), 1e300),
                         (PrivacyBudget(schedule(rounds=20, join_ratio=0.5), 'local', 1.0, 1e-5, 'rdp'), 1e300)):
    with pytest.raises(ConfigError, match=r'^--dp_target_epsilon=1e\+300: the accountant finds no noise multiplier '
                                          r'for it over this run \(20 rounds, delta 1e-05\).*Fix: '):
      calibrate(budget, target)
  with pytest.raises(ConfigError, match=r'^--dp_target_epsilon=3: the run has no rounds.*Fix: --rounds > 0'):
    calibrate(PrivacyBudget(schedule(rounds=0), 'central', 1.0, 1e-5), 3.0)


def test_a_calibration_beyond_what_the_accountant_computes_in_bounded_time_is_refused_and_draws_once(monkeypatch):
  """--dp_target_epsilon with --rounds=100000000 printed nothing for hours: the calibration drew every round's
  participants again for every sigma it tried. Refused as the config is made (and by `calibrate` itself) beyond
  MAX_CALIBRATED_ROUNDS; below it the participants are drawn once, whatever the sigmas tried."""
  from fedjax_het.privacy.budget import MAX_CALIBRATED_ROUNDS
  for mode in ('local', 'central'):
    with pytest.raises(ConfigError, match=r'^--dp_target_epsilon=3 with --rounds=100000000: calibrating the noise .*'
                                          r'takes minutes to hours before the first round\. Fix: set the noise with '
                                          r'--dp_noise_multiplier instead .*, or at most --rounds=100000\.$'):
      dataclasses.replace(CFG, dp_mode=mode, dp_target_epsilon=3.0, rounds=10**8)
  dataclasses.replace(CFG, dp_mode='local', dp_noise_multiplier=1.0, rounds=10**8)  # a set sigma: no calibration
  drawn = []
  original = Schedule.participants
  monkeypatch.setattr(Schedule, 'participants', lambda self, r: drawn.append(r) or original(self, r))
  with pytest.raises(ConfigError, match=r'^--dp_target_epsilon=3 with --rounds=100001: '):
    calibrate(PrivacyBudget(schedule(rounds=MAX_CALIBRATED_ROUNDS + 1), 'local', 1.0, 1e-5), 3.0)
  assert drawn == []  # refused before any draw
  budget = PrivacyBudget(schedule(rounds=2000), 'local', 1.0, 1e-5)
  sigma = calibrate(budget, 3.0)
  assert sorted(drawn) == list(range(2000))  # each round drawn once
  assert dataclasses.replace(budget, noise_multiplier=sigma).epsilon(2000) == pytest.approx(3.0, rel=1e-3)


def test_a_signal_during_the_calibration_stops_it_before_anything_is_written(tmp_path, monkeypatch, capsys):
  """The calibration, Python work of seconds before the first round, now reads the stop request between its steps:
  a SIGTERM stops it within a few thousand rounds drawn (Interrupted: exit 143 from the entry points), where it
  used to be acknowledged and then ignored until the calibration ended."""
  import os
  import signal
  from fedjax_het.run.interrupts import Interrupted
  drawn = []
  original = Schedule.participants

  def participants(self, r):
    drawn.append(r)
    if len(drawn) == 10:
      os.kill(os.getpid(), signal.SIGTERM)
    return original(self, r)
  monkeypatch.setattr(Schedule, 'participants', participants)
  cfg = dataclasses.replace(CFG, dp_mode='local', dp_target_epsilon=3.0, rounds=20000)
  with pytest.raises(Interrupted) as stopped:
    train_and_evaluate(cfg, str(tmp_path / 'run'), progress=True)
  assert (stopped.value.signal_name, stopped.value.rounds_done, stopped.value.resumable) == ('SIGTERM', 0, False)
  assert len(drawn) <= 5000 + 10  # the draws of one step, not the run's 20,000 for each sigma tried
  assert not {'config.json', 'metrics.jsonl', 'checkpoints', 'summary.json'} & set(os.listdir(tmp_path / 'run'))
  err = capsys.readouterr().err
  assert 'then calibrating the DP noise to --dp_target_epsilon=3' in err and 'SIGTERM: finishing this round' in err


def test_settings_the_accountant_cannot_bound_or_lacking_noise_are_refused_naming_the_flag():
  with pytest.raises(ConfigError, match='exactly one of --dp_noise_multiplier'):
    dataclasses.replace(CFG, dp_mode='central')
  with pytest.raises(ConfigError, match='--dp_clip=-1'):
    dataclasses.replace(CFG, dp_mode='central', dp_noise_multiplier=1.0, dp_clip=-1.0)
  cfg = dataclasses.replace(CFG, dp_mode='central', dp_noise_multiplier=1.0, dp_accountant='pld',
                            dp_parts=('label', 'weight'))  # amplified rounds
  with pytest.raises(ConfigError, match="--dp_accountant='pld'.*Poisson.*--join_ratio=1"):
    private_algorithm(cfg, make_algorithm(cfg, tiny_data()), 4)
  with pytest.raises(ConfigError, match='--dp_noise_multiplier, --dp_target_epsilon and --dp_parts act only under'):
    dataclasses.replace(CFG, dp_target_epsilon=3.0)  # without --dp_mode: refused, not ignored
  fedre_ = make_algorithm(CFG, tiny_data())
  with pytest.raises(ConfigError, match='fedre has no public upload part reps; .* label, weight'):
    privatize(fedre_, DPConfig('local', 1.0, 1.0, parts=('reps',)))  # a typo is not dropped
  fedproto_ = make_algorithm(dataclasses.replace(CFG, algorithm='fedproto'), tiny_data())
  with pytest.raises(ConfigError, match='reads from its public parts which entries each client holds'):
    privatize(fedproto_, DPConfig('central', 1.0, 1.0, parts=('counts',)))
  with pytest.raises(ConfigError, match="uploads 'row_labels' as int32, which Gaussian noise cannot protect"):
    privatize_upload({'rows': jnp.ones(2), 'row_labels': jnp.ones(2, jnp.int32)}, None, UploadPrivacy(),
                     DPConfig('local', 1.0, 1.0), KEY, 'velo')
  # --dp_parts adds a public part to the private ones: FedRE's label is clipped with its representation
  both = privatize_upload(FedREUpload(jnp.array([3., 0.]), jnp.array([0., 4.]), jnp.ones(1)), None,
                          UploadPrivacy(public=('label', 'weight')), DPConfig('central', 1.0, 1.0, parts=('label',)),
                          KEY, 'fedre')
  assert isinstance(both, FedREUpload)
  np.testing.assert_allclose(jnp.concatenate([both.rep, both.label]), [0.6, 0., 0., 0.8], rtol=1e-6)


# ---------------------------------------------------------------- runs
def test_dp_off_is_the_method_itself():
  """Off (the default), the method is returned as it is: every number is the golden run's."""
  algorithm = make_algorithm(CFG, tiny_data())
  assert privatize(algorithm, DPConfig()) is algorithm
  assert private_algorithm(CFG, algorithm, 4) == (algorithm, None)


@pytest.mark.parametrize('name,mode', [('fedproto', 'central'), pytest.param('fedre', 'local', marks=pytest.mark.slow)])
def test_vmap_equals_sequential_with_dp(name, mode):
  data = tiny_data()
  cfg = ExperimentConfig(algorithm=name, **TINY)
  runs = []
  for strategy in ('sequential', 'vmap'):
    algorithm = privatize(make_algorithm(cfg, data), DPConfig(mode, clip=0.5, noise_multiplier=0.8))
    fed = Federation(algorithm, data, ModelConfig(('small_cnn_narrow', 'mlp'), 16), LocalTraining(0.05, 8, 1),
                     ExecutionConfig(strategy=strategy, conv='xla'), join_ratio=0.5, rounds=2)
    state, rows = fed.init(), []
    for _ in range(2):
      state, m = fed.round(state)
      rows.append(m)
    runs.append((state.server, rows))
  (a, rows_a), (b, rows_b) = runs
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-5)
  for ra, rb in zip(rows_a, rows_b):
    assert ra['train_loss'] == pytest.approx(rb['train_loss'], rel=2e-4)


def test_a_dp_run_resumes_to_the_uninterrupted_numbers_and_epsilon(tmp_path):
  cfg = dataclasses.replace(CFG, dp_mode='central', dp_noise_multiplier=1.0, dp_clip=0.5, dp_reproducible_noise=True)
  full, part = str(tmp_path / 'full'), str(tmp_path / 'part')
  summary = train_and_evaluate(cfg, full, progress=False)
  train_and_evaluate(dataclasses.replace(cfg, rounds=3), part, progress=False)
  train_and_evaluate(cfg, part, resume=True, progress=False)  # from the checkpoint of round 2
  rows = metric_rows(full)
  assert metric_rows(part) == rows
  # FedRE's public label says who took part: no amplification, every round a client joined counts in full
  budget = PrivacyBudget(Schedule('fedre', (Phase('fedre', None, None),), 4, 4, 0.5), 'central', 1.0, 1e-5,
                         hides_participants=False)
  assert [r['dp_epsilon'] for r in rows] == pytest.approx([budget.epsilon(r) for r in (1, 2, 3, 4)], rel=1e-9)
  assert {k: summary['dp'][k] for k in ('mode', 'epsilon', 'delta', 'noise_multiplier', 'clip', 'accountant')} == {
      'mode': 'central', 'epsilon': rows[-1]['dp_epsilon'], 'delta': 1e-5, 'noise_multiplier': 1.0, 'clip': 0.5,
      'accountant': 'rdp'}
  # sigma calibrated to the whole run: its length may not change on resume
  run = Run(10, 4, 4, 16, None)
  assert 'rounds' in resumable_fields(run, cfg)
  assert 'rounds' not in resumable_fields(run, dataclasses.replace(cfg, dp_noise_multiplier=0.0,
                                                                   dp_target_epsilon=3.0))


def test_the_tradeoff_table_json_and_plot_put_every_method_on_the_same_axes(tmp_path):
  def runs(name, accuracies, spent=None):
    return MethodResult(name, [{'final_accuracy': a, 'dp': spent and {'epsilon': spent, 'noise_multiplier': 2.5}}
                               for a in accuracies], [])
  points = [TradeoffPoint('fedre', 1.0, runs('fedre', [0.5, 0.7], 0.99)),
            TradeoffPoint('fedre', math.inf, runs('fedre', [0.9, 0.8])),
            TradeoffPoint('local', math.inf, runs('local', [0.6, 0.6]))]
  table = write_tradeoff(points, str(tmp_path), 'test')
  assert table == ('| method | epsilon 1 | no DP | seeds |\n|---|---|---|---|\n'
                   '| fedre | 60.00 +- 10.00 | 85.00 +- 5.00 | 2 |\n| local |  | 60.00 +- 0.00 | 2 |\n')
  saved = json.load(open(tmp_path / 'privacy_utility.json'))
  assert saved[0] == {'algorithm': 'fedre', 'target_epsilon': 1.0, 'spent_epsilon': [0.99, 0.99],
                      'final_accuracy': [0.5, 0.7], 'noise_multiplier': [2.5, 2.5]}
  assert saved[1]['target_epsilon'] is None and (tmp_path / 'privacy_utility.png').stat().st_size > 0
  with pytest.raises(ConfigError, match='--dp_mode=off: the trade-off needs'):
    run_tradeoff(CFG, 'off', ['fedre'], [1.0], [0], str(tmp_path / 'never'))


def test_an_infinite_epsilon_is_written_as_strict_json(tmp_path):
  """--dp_noise_multiplier=1e-300 spends an infinite epsilon: metrics.jsonl and summary.json say so in standard
  JSON (null, and beside it dp_epsilon_not_finite), not as the `Infinity` other JSON readers refuse."""
  cfg = dataclasses.replace(CFG, rounds=2, dp_mode='local', dp_noise_multiplier=1e-300)
  train_and_evaluate(cfg, str(tmp_path), progress=False)

  def refuse(constant):
    raise ValueError(f'{constant} is not JSON')
  for line in (tmp_path / 'metrics.jsonl').read_text().splitlines():
    row = json.loads(line, parse_constant=refuse)
    assert row['dp_epsilon'] is None and row['dp_epsilon_not_finite'] == 'inf'
  json.loads((tmp_path / 'summary.json').read_text(), parse_constant=refuse)


def test_the_tradeoff_refuses_a_noise_it_would_ignore(tmp_path):
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = subprocess.run([sys.executable, os.path.join(root, 'experiments', 'compare.py'), '--algorithms=fedre',
                         '--dataset=digits', '--epsilons=1,inf', '--dp_mode=central', '--dp_noise_multiplier=2',
                         f'--workdir={tmp_path}'], capture_output=True, text=True, timeout=300)
  assert done.returncode == 2
  assert done.stderr.strip().splitlines()[-1] == (
      'error: --dp_noise_multiplier=2.0 with --epsilons: each point of the trade-off calibrates its noise to its own '
      'epsilon, so this value would be ignored. Fix: leave --dp_noise_multiplier out (or drop --epsilons to compare '
      'the methods at that noise).')
  assert not os.listdir(tmp_path)


def test_a_resumed_run_accounts_the_rounds_that_ran_as_they_ran():
  """Ten rounds, the last five with every client; resumed to twenty rounds, whose full-participation rounds are now
  16-20: rounds 6-10 still ran with every client. Accounting them as sampled (the run's present settings)
  reported 3.81 where 6.25 was spent."""
  ran = PrivacyBudget(dataclasses.replace(schedule(rounds=10), full_participation_rounds=5), 'central', 4.0, 1e-5)
  longer = PrivacyBudget(dataclasses.replace(schedule(rounds=20), full_participation_rounds=5), 'central', 4.0, 1e-5)
  resumed = longer.after([{'participants': n} for n in [5] * 5 + [20] * 5])
  assert resumed.epsilon(10) == ran.epsilon(10) > longer.epsilon(10) + 2
  assert resumed.draws(12) == [(5, 5), (20, 5), (5, 2)]


@pytest.mark.slow
def test_end_to_end_the_resumed_epsilon_continues_from_what_ran(tmp_path):
  cfg = dataclasses.replace(CFG, dp_mode='central', dp_noise_multiplier=4.0, join_ratio=0.5,
                            dp_parts=('label', 'weight'),  # amplified: the sample sizes count
                            full_participation_rounds=2, rounds=4, checkpoint_every=1,
                            dp_reproducible_noise=True)  # the seed's draw, which `as_ran` draws again
  train_and_evaluate(cfg, str(tmp_path), progress=False)
  first = metric_rows(tmp_path)
  train_and_evaluate(dataclasses.replace(cfg, rounds=6), str(tmp_path), resume=True, progress=False)
  rows = metric_rows(tmp_path)
  assert [r['participants'] for r in rows] == [2, 2, 4, 4, 4, 4] and rows[:4] == first
  # What ran up to round 5 is a 5-round run whose last 3 rounds had every client: its epsilon, drawn afresh.
  phases = make_algorithm(cfg, tiny_data()).phases
  as_ran = PrivacyBudget(Schedule('fedre', phases, 4, 5, 0.5, 3, cfg.seed), 'central', 4.0, 1e-5)
  assert rows[4]['dp_epsilon'] == pytest.approx(as_ran.epsilon(5), rel=1e-9)


def test_a_delta_of_one_over_the_clients_or_more_is_refused_unless_allowed():
  with pytest.raises(ConfigError, match=r'^PrivacyBudget.delta=0.05 is at least 1 / clients \(0.05 here\).*Fix: a '
                                        r'delta below 0.05'):
    PrivacyBudget(schedule(), 'central', 1.0, 0.05)
  assert PrivacyBudget(schedule(), 'central', 1.0, 0.05, allow_large_delta=True).epsilon(1) > 0
  cfg = dataclasses.replace(CFG, dp_mode='central', dp_noise_multiplier=1.0, dp_delta=0.3)
  with pytest.raises(ConfigError, match=r'^--dp_delta=0.3 is at least 1 / clients .* or --dp_allow_large_delta'):
    private_algorithm(cfg, make_algorithm(cfg, tiny_data()), 4)


def test_only_a_method_whose_public_parts_cannot_tell_who_took_part_counts_on_the_draw():
  """FedRE's soft label trains the released head: left public, it says who was drawn, so no amplification; with
  the label and weight private it may. FedAllRep never (how many rows the head trains on depends on who was drawn);
  grouped FedAvg never (a group model unchanged when its group had nobody)."""
  def sampled(algorithm, **dp):
    cfg = dataclasses.replace(CFG, algorithm=algorithm, dp_mode='central', dp_noise_multiplier=1.0, join_ratio=0.5,
                              **dp)
    return private_algorithm(cfg, make_algorithm(cfg, tiny_data()), 4)[1]
  assert not sampled('fedre').sampled and sampled('fedre').public_parts == ('label', 'weight')
  assert sampled('fedre', dp_parts=('label', 'weight')).sampled
  assert not sampled('fedre', dp_parts=('label',)).sampled
  allrep = dataclasses.replace(CFG, methods={**CFG.methods, 'fedre': dataclasses.replace(
      CFG.methods['fedre'], all_representations=True)})
  cfg = dataclasses.replace(allrep, dp_mode='central', dp_noise_multiplier=1.0, join_ratio=0.5,
                            dp_parts=('label', 'weight'))
  assert not private_algorithm(cfg, make_algorithm(cfg, tiny_data()), 4)[1].sampled
  assert not sampled('fedavg').sampled


def test_under_dp_the_summary_says_what_its_epsilon_means_and_rows_hold_nothing_of_the_participants(tmp_path):
  cfg = dataclasses.replace(CFG, rounds=2, dp_mode='central', dp_noise_multiplier=1.0)
  summary = train_and_evaluate(cfg, str(tmp_path), progress=False)
  dp = summary['dp']
  assert {k: dp[k] for k in ('mode', 'delta', 'noise_multiplier', 'accountant', 'adjacency', 'sampling',
                             'amplified_by_sampling', 'public_parts')} == {
      'mode': 'central', 'delta': 1e-5, 'noise_multiplier': 1.0, 'accountant': 'rdp',
      'adjacency': 'replace-one client (all of its data)', 'sampling': 'fixed-size draw without replacement',
      'amplified_by_sampling': False, 'public_parts': ['label', 'weight']}
  assert dp['holds_for'] == 'federations that differ in one client\'s data and agree on the public parts'
  assert dp['epsilon'] > 0 and 'noise_source' in dp
  for row in metric_rows(tmp_path):
    assert not {'train_loss', 'local_steps', 'local_samples'} & set(row) and row['dp_epsilon'] > 0


def test_docs_list_every_methods_public_parts_and_whether_it_is_amplified():
  """docs/privacy.md's table per method against each method's declaration (`Algorithm.upload_privacy`): its public
  parts (what the epsilon does not cover) and whether its central rounds count on the draw, fixed-size or Poisson."""
  import os
  from fedjax_het.run.experiment import build_federation
  from fedjax_het.run.registry import METHODS
  from fedjax_het.privacy.dp import claims_amplification
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, 'docs', 'privacy.md')) as f:
    text = f.read()
  rows = text[text.index('| method | contribution'):].split('\n\n')[0].splitlines()[2:]
  table = {cells[0]: cells for cells in ([c.strip() for c in line.strip().strip('|').split('|')] for line in rows)}
  for name in METHODS:
    cfg = dataclasses.replace(CFG, algorithm=name, feature_dim=256, public_size=64 if name in ('fedmd', 'feddf')
                              else 0)
    declared = (build_federation(cfg).algorithm if cfg.public_size else make_algorithm(cfg, tiny_data())
                ).upload_privacy
    assert name in table, f'docs/privacy.md has no row for {name}'
    _, _, _, public, amplified, poisson = table[name]
    assert public == (', '.join(f'`{p}`' for p in declared.public) or 'none'), name
    expected = ('yes' if claims_amplification(declared) else
                f'with `--dp_parts={",".join(declared.public)}`' if declared.hides_participants else 'no')
    assert amplified == expected, name
    assert poisson == ('yes' if claims_amplification(declared, declared.public, 'poisson') else 'no'), name


def test_under_dp_the_noise_and_an_amplified_draw_are_secret_unless_asked_to_be_reproducible():
  """The round keys (every client's and the server's randomness, their DP noise included) and, for amplified rounds,
  the participant draw came from --seed, which Flower sends every node: the server could regenerate a client's
  local noise and subtract it. Under DP they now come from each process's own entropy."""
  from fedjax_het.run.experiment import build_federation
  seeded = build_federation(CFG)
  local = dataclasses.replace(CFG, dp_mode='local', dp_noise_multiplier=1.0)
  a, b = build_federation(local), build_federation(local)
  keys = lambda fed: np.asarray(jax.random.key_data(fed.round_keys(0)[0]) if jnp.issubdtype(
      fed.round_keys(0)[0].dtype, jax.dtypes.prng_key) else fed.round_keys(0)[0])
  assert not np.array_equal(keys(a), keys(b)) and not np.array_equal(keys(a), keys(seeded))
  again = build_federation(dataclasses.replace(local, dp_reproducible_noise=True))
  np.testing.assert_array_equal(keys(again), keys(seeded))
  amplified = dataclasses.replace(local, dp_mode='central', join_ratio=0.5, dp_parts=('label', 'weight'))
  draws = lambda fed: [fed.participants(r).tolist() for r in range(12)]
  assert draws(build_federation(amplified)) != draws(build_federation(amplified))
  public_draw = draws(build_federation(dataclasses.replace(CFG, join_ratio=0.5)))
  assert draws(build_federation(dataclasses.replace(amplified, dp_reproducible_noise=True))) == public_draw
  # local mode: the draw is the seed's (the accounting counts the most joins of that known draw)
  assert draws(build_federation(dataclasses.replace(local, join_ratio=0.5))) == public_draw


def _upload_parts_under_local_dp(name: str) -> dict:
  """part -> whether client 0's first upload of method `name` is the same with local DP as without (same state,
  broadcast and key), for its parts that hold arrays; a ConfigError where DP refuses the method."""
  from golden import make_golden_federation
  from fedjax_het.core import for_client
  from fedjax_het.engine.groups import host_copy
  plain = make_golden_federation(name)
  private = Federation(privatize(plain.algorithm, DPConfig('local', clip=1e-3, noise_multiplier=1.0)), plain.data,
                       plain.models, plain.training, plain.execution, join_ratio=0.5, rounds=plain.total_rounds)
  state = plain.init()
  g, key = plain.groups[0], plain.round_keys(0)[0]
  uploads = []
  for fed in (plain, private):
    client = host_copy(state.groups[0], 0)
    broadcast = for_client(fed.broadcast(state.server, 0, 0), 0)
    uploads.append(fed.executor.run_one(g, fed.programs[0][0], 0, 0, client, broadcast, key)[1])
  if not isinstance(uploads[0], dict):
    return {'all': False}
  return {part: all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(uploads[0][part]),
                                                          jax.tree.leaves(uploads[1][part])))
          for part in uploads[0] if jax.tree.leaves(uploads[0][part])}


def _check_declaration(name: str) -> None:
  from fedjax_het.run.registry import METHODS
  try:
    same = _upload_parts_under_local_dp(name)
  except ConfigError as e:  # refused under DP, with the reason (an integer part noise cannot protect)
    assert 'Gaussian noise cannot protect' in str(e) or 'cannot' in str(e), (name, str(e))
    return
  from golden import make_golden_federation
  public = make_golden_federation(name).algorithm.upload_privacy.public
  for part, unchanged in same.items():
    assert unchanged == (part in public), (f'{name}: upload part {part!r} is '
                                           f'{"unchanged" if unchanged else "changed"} by local DP but '
                                           f'{"" if part in public else "not "}declared public')
  assert name in METHODS


@pytest.mark.parametrize('name', ['fedre', 'fedproto', 'fedavg', pytest.param('heterofl', marks=pytest.mark.slow)])
def test_every_upload_part_is_noised_or_declared_public(name):
  """What a client sends under local DP against what it sends without, same state and key: a part the method
  declares public passes as it is, every other part is clipped and noised. (HeteroFL's sub-model slices and every
  other method: -m slow.)"""
  _check_declaration(name)


@pytest.mark.slow
def test_every_methods_upload_parts_are_noised_or_declared_public():
  from fedjax_het.run.registry import METHODS
  for name in METHODS:
    _check_declaration(name)


@pytest.mark.slow  # a resume on the secret path in the default run: test_dp_release.py, the secret put back
def test_a_run_with_secret_noise_resumes_to_the_uninterrupted_numbers(tmp_path, monkeypatch):
  """The secret (noise and amplified draw) is the workdir's `.dp_secret`, readable by its owner only: a resumed run
  continues the same noise; two runs from the same seed share nothing of it."""
  import os
  import stat
  from fedjax_het.run import experiment
  monkeypatch.setattr(experiment.secrets, 'randbits', lambda bits: 123456789)  # the same entropy for both runs
  cfg = dataclasses.replace(CFG, dp_mode='central', dp_noise_multiplier=1.0, dp_parts=('label', 'weight'))
  train_and_evaluate(cfg, str(tmp_path / 'full'), progress=False)
  train_and_evaluate(dataclasses.replace(cfg, rounds=3), str(tmp_path / 'part'), progress=False)
  train_and_evaluate(cfg, str(tmp_path / 'part'), resume=True, progress=False)
  assert metric_rows(tmp_path / 'part') == metric_rows(tmp_path / 'full')
  assert stat.S_IMODE(os.stat(tmp_path / 'full' / '.dp_secret').st_mode) & 0o077 == 0
  monkeypatch.setattr(experiment.secrets, 'randbits', lambda bits: 987654321)
  train_and_evaluate(cfg, str(tmp_path / 'other'), progress=False)
  seeded = train_and_evaluate(dataclasses.replace(cfg, dp_reproducible_noise=True), str(tmp_path / 'seeded'),
                              progress=False)
  accuracy = lambda d: [r['accuracy'] for r in metric_rows(tmp_path / d)]
  assert len({tuple(accuracy(d)) for d in ('full', 'other', 'seeded')}) == 3
  assert seeded['dp']['noise_source'].startswith('the run\'s seed (--dp_reproducible_noise)')


def test_an_amplified_run_reports_the_bound_that_does_not_depend_on_the_draw_and_calibrates_on_it():
  """N = 10, n = 5, T = 20, sigma = 2: the subsampled Gaussian's composition gives 27.29, the client that joined most
  often (14 of the 20 rounds in this draw) 23.73; both bound the run, but the second is a function of the secret
  draw (printed each round, or calibrated on, it would release how often a client was drawn): it reports 27.29."""
  budget = PrivacyBudget(schedule(num_clients=10, rounds=20, join_ratio=0.5), 'central', 2.0, 1e-5)
  acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
  acc.compose(dp_accounting.SelfComposedDpEvent(
      dp_accounting.SampledWithoutReplacementDpEvent(10, 5, dp_accounting.GaussianDpEvent(1.0)), 20))
  counts = np.zeros(10, int)
  for r in range(20):
    counts[schedule(num_clients=10, rounds=20, join_ratio=0.5).participants(r)] += 1
  alone = rdp.RdpAccountant()
  alone.compose(dp_accounting.GaussianDpEvent(1.0 / math.sqrt(counts.max())))
  assert acc.get_epsilon(1e-5) == pytest.approx(27.29, abs=0.01) and counts.max() == 14
  assert budget.realised_epsilon(20) == pytest.approx(alone.get_epsilon(1e-5), rel=1e-9) == pytest.approx(23.73,
                                                                                                        abs=0.01)
  assert budget.epsilon(20) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-6)
  other = PrivacyBudget(dataclasses.replace(budget.schedule, seed=1), 'central', 2.0, 1e-5)  # another draw
  assert other.realised_epsilon(20) != budget.realised_epsilon(20) and other.epsilon(20) == budget.epsilon(20)
  sigma = calibrate(budget, 8.0)
  assert dataclasses.replace(budget, noise_multiplier=sigma).epsilon(20) == pytest.approx(8.0, rel=1e-3)
  assert dataclasses.replace(budget, noise_multiplier=0.99 * sigma).epsilon(20) > 8.0


def _released_for_draws(name: str, parts: tuple, draws: list) -> list:
  """(broadcast after round 1, metrics row without timings) of method `name` under central DP whose contributions
  are clipped to nothing (C = 1e-9, sigma = 1e-12), once per participant set in `draws`, from one initial state: what
  the server releases apart from the noised contributions."""
  from golden import make_golden_federation
  plain = make_golden_federation(name)
  fed = Federation(privatize(plain.algorithm, DPConfig('central', clip=1e-9, noise_multiplier=1e-12, parts=parts)),
                   plain.data, plain.models, plain.training, plain.execution, join_ratio=0.5,
                   rounds=plain.total_rounds)
  state = fed.init()
  out = []
  for chosen in draws:
    fed.participants = lambda r, chosen=chosen: np.asarray(chosen)
    new, row = fed.round(jax.device_put(state, may_alias=False))  # a round donates the states it is given
    out.append(([np.asarray(a) for a in jax.tree.leaves(fed.sent(new.server, 0, 1))],
                {k: v for k, v in row.items() if 'seconds' not in k and k not in ('train_loss', 'local_steps',
                                                                                 'local_samples')}))
  return out


def _hides_the_draw(name: str, parts: tuple = ()) -> bool:
  """Whether the broadcast and the metrics row (communication counts, participants, the server's own metrics) are
  the same for two draws that differ in one client."""
  (a, row_a), (b, row_b) = _released_for_draws(name, parts, [[0, 1, 2], [0, 1, 3]])
  same_row = row_a.keys() == row_b.keys() and all(
      np.allclose(row_a[k], row_b[k], atol=1e-6) if isinstance(row_a[k], float) else row_a[k] == row_b[k]
      for k in row_a)
  return same_row and all(np.allclose(x, y, atol=1e-6) for x, y in zip(a, b))


def test_what_the_server_releases_apart_from_the_noise_is_the_same_for_neighbouring_draws():
  """The declaration behind amplification, tested: with every contribution clipped to nothing, what FedRE's server
  releases after a round drawing clients {0, 1, 2} equals what it releases after {0, 1, 3} once its label and weight
  are private; with them public the released head differs (its public labels say who was drawn), which is why
  FedRE alone may not count on the draw. (Every method that claims it: -m slow.)"""
  from golden import make_golden_federation
  from fedjax_het.privacy.dp import claims_amplification
  declared = make_golden_federation('fedre').algorithm.upload_privacy
  for parts in (('label', 'weight'), ()):
    assert claims_amplification(declared, parts) == _hides_the_draw('fedre', parts) == bool(parts), parts


@pytest.mark.slow
def test_every_method_that_counts_on_the_draw_releases_nothing_else_of_it():
  from fedjax_het.run.registry import METHODS
  from golden import make_golden_federation
  from fedjax_het.privacy.dp import claims_amplification
  checked = []
  for name in METHODS:
    declared = make_golden_federation(name).algorithm.upload_privacy
    if claims_amplification(declared, declared.public):  # counts on the draw, with every public part private
      assert _hides_the_draw(name, declared.public), name
      checked.append(name)
  assert {'fedre', 'lg_fedavg', 'fml'} <= set(checked), checked


def test_the_one_run_audits_bound_by_hand():
  """benchmarks/dp_audit.py's bound ("Privacy Auditing with One (1) Training Run", Sec. 3): 20 guesses, all right,
  delta 0: rejected at 95 % while q^20 < 0.05 for q = e^eps / (1 + e^eps), i.e. up to
  eps = ln(q / (1 - q)) with q = 0.05^(1/20) = 0.86089: 1.8231. Half right is no evidence; delta adds its term."""
  import os
  import sys
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'benchmarks'))
  from dp_audit import audit_epsilon, audit_p_value
  q = 0.05 ** (1 / 20)
  assert audit_epsilon(20, 20, 20, 0.0, 0.95) == pytest.approx(math.log(q / (1 - q)), abs=2e-3)
  assert audit_p_value(20, 20, 20, 0.0, 0.0) == pytest.approx(0.5 ** 20)
  assert audit_epsilon(1000, 200, 100, 0.0, 0.95) == 0.0
  assert audit_p_value(1000, 200, 180, 2.0, 1e-5) > audit_p_value(1000, 200, 180, 2.0, 0.0)
