"""Robust aggregation (fedjax_het.robust): the median, trimmed mean and norm bound by hand, absent participants
included; the server step of the averaging methods under it; the methods it applies to and the settings it refuses.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_het import robust
from fedjax_het.core import Uploads
from fedjax_het.errors import ConfigError
from fedjax_het.robust import RobustConfig

# Five slots of two coordinates; slot 4 holds no participant (its values must count for nothing).
VALUES = jnp.array([[1.0, 10.0], [5.0, 2.0], [100.0, 3.0], [7.0, -4.0], [1e9, -1e9]])
PRESENT = jnp.array([True, True, True, True, False])


def test_the_median_by_hand_over_the_participants_only():
  # participants' column 0: 1, 5, 7, 100 -> (5 + 7) / 2; column 1: -4, 2, 3, 10 -> (2 + 3) / 2
  np.testing.assert_allclose(robust.masked_median(VALUES, PRESENT), [6.0, 2.5])
  # an odd count: slots 0, 2, 3: column 0: 1, 7, 100 -> 7; column 1: -4, 3, 10 -> 3
  np.testing.assert_allclose(robust.masked_median(VALUES, jnp.array([1, 0, 1, 1, 0])), [7.0, 3.0])
  np.testing.assert_allclose(robust.masked_median(VALUES, jnp.array([0, 0, 1, 0, 0])), [100.0, 3.0])  # one
  np.testing.assert_allclose(robust.masked_median(VALUES, jnp.zeros(5)), [0.0, 0.0])  # nobody


def test_the_trimmed_mean_by_hand_over_the_participants_only():
  # 4 participants, trim 0.25: one dropped at each end -> the mean of the middle two
  np.testing.assert_allclose(robust.masked_trimmed_mean(VALUES, PRESENT, 0.25), [6.0, 2.5])
  # trim 0.2 of 4 participants drops floor(0.8) = 0: the plain mean, slot 4 left out
  np.testing.assert_allclose(robust.masked_trimmed_mean(VALUES, PRESENT, 0.2), [113 / 4, 11 / 4])
  # 3 participants (slots 0, 1, 2), trim 0.34: floor(1.02) = 1 each side -> the median
  np.testing.assert_allclose(robust.masked_trimmed_mean(VALUES, jnp.array([1, 1, 1, 0, 0]), 0.34), [5.0, 3.0])
  np.testing.assert_allclose(robust.masked_trimmed_mean(VALUES, jnp.zeros(5), 0.2), [0.0, 0.0])


def test_the_norm_bound_by_hand_relative_to_the_median_update_norm():
  deltas = {'w': jnp.array([[3.0, 4.0], [0.0, 1.0], [30.0, 40.0], [600.0, 800.0]]), 'b': jnp.zeros((4, 1))}
  mask = jnp.array([True, True, True, False])  # slot 3 absent: its norm 1000 must not enter the median
  bounded, bound, scaled = robust.bound_norms(deltas, mask, 2.0)
  # norms 5, 1, 50 -> median 5 -> bound 10: only slot 2 is scaled, to norm 10 along its direction
  assert float(bound) == 10.0 and scaled.tolist() == [False, False, True, False]
  np.testing.assert_allclose(bounded['w'], [[3, 4], [0, 1], [6, 8], [600, 800]])
  np.testing.assert_array_equal(robust.update_norms(deltas, mask), [5.0, 1.0, 50.0, 0.0])
  # with slot 3 present the median of 5, 1, 50, 1000 is 27.5, the bound 55: nobody is scaled
  _, bound, scaled = robust.bound_norms(deltas, jnp.ones(4, bool), 2.0)
  assert float(bound) == 55.0 and not scaled[:3].any() and bool(scaled[3])


def _uploads(models, mask, rows):
  return Uploads({'model': {'w': jnp.asarray(models)}}, jnp.asarray(mask), jnp.asarray(rows, jnp.float32))


def test_a_rounds_uploads_within_groups_and_across_them():
  """Group 0: three participants and an empty slot; group 1: two participants. Within groups each group's
  statistic; across them ('all', a head every group averages) one statistic of the five."""
  g0 = _uploads([[1.0], [2.0], [900.0], [-1e9]], [1, 1, 1, 0], [10, 10, 10, 0])
  g1 = _uploads([[4.0], [8.0]], [1, 1], [5, 15])
  references = [{'model': {'w': jnp.array([0.0])}}, {'model': {'w': jnp.array([0.0])}}]
  (a, b), _ = robust.robust_uploads((g0, g1), references, 'group', RobustConfig('median'))
  np.testing.assert_array_equal(a.values['model']['w'][:, 0], [2, 2, 2, -1e9])  # the empty slot as it was
  np.testing.assert_array_equal(b.values['model']['w'][:, 0], [6, 6])
  # the method's own weighted mean of the replaced copies is the statistic
  assert float(a.mean('model', by='rows')['w'][0]) == pytest.approx(2.0)
  (a, b), _ = robust.robust_uploads((g0, g1), references, 'all', RobustConfig('median'))  # 1, 2, 4, 8, 900 -> 4
  assert a.values['model']['w'][:3, 0].tolist() == [4, 4, 4] and b.values['model']['w'][:, 0].tolist() == [4, 4]
  # norm bound around the reference 0: norms 1, 2, 900 in group 0 -> bound 2 x 2 = 4; group 1 within its 2 x 6
  (a, b), metrics = robust.robust_uploads((g0, g1), references, 'group', RobustConfig('norm_bound', multiplier=2.0))
  np.testing.assert_array_equal(a.values['model']['w'][:, 0], [1, 2, 4, -1e9])
  np.testing.assert_array_equal(b.values['model']['w'][:, 0], [4, 8])
  assert int(metrics['robust_clipped']) == 1


def test_the_methods_it_applies_to_and_the_settings_it_refuses():
  from fedjax_het.run.config import ExperimentConfig
  from fedjax_het.run.registry import METHODS, Run, method
  from fedjax_het.data.federated import PublicData
  public = PublicData(np.zeros((4, 8, 8, 1), np.float32), np.zeros(4, np.int32), 'test')
  run = Run(10, 4, 2, 512, lambda: np.ones(10), public)
  averaging = {name for name in METHODS if robust.averaged_parts(
      method(name).algorithm(ExperimentConfig().methods[name], run).upload_privacy) is not None}
  listed = {'fedavg', 'fedprox', 'fedala', 'lg_fedavg', 'avgkd', 'fml', 'fedmrl', 'fedtype', 'pfedafm'}
  assert averaging == listed
  help_text = dataclasses.fields(ExperimentConfig)[[f.name for f in dataclasses.fields(ExperimentConfig)].index(
      'robust_aggregation')].metadata['help']
  assert all(name in help_text for name in listed)
  fedre = method('fedre').algorithm(ExperimentConfig().methods['fedre'], run)
  with pytest.raises(ConfigError, match=r"RobustConfig.mode='median': fedre's server does not read .* Fix: "):
    robust.robust_aggregation(fedre, RobustConfig('median'))
  assert robust.robust_aggregation(fedre, RobustConfig('none')) is fedre
  for bad, says in [(dict(robust_aggregation='median', dp_mode='central', dp_noise_multiplier=1.0),
                     r'^--robust_aggregation=median under --dp_mode=central: .* Fix: --dp_mode=local'),
                    (dict(robust_aggregation='trimmed_mean', robust_trim=0.5), r'^--robust_trim=0.5 must be in'),
                    (dict(robust_aggregation='norm_bound', robust_norm_multiplier=0.0),
                     r'^--robust_norm_multiplier=0.0 must be a positive number.* Fix: ')]:
    with pytest.raises(ConfigError, match=says):
      ExperimentConfig(**bad)
  ExperimentConfig(robust_aggregation='median', dp_mode='local', dp_noise_multiplier=1.0)  # post-processing


def test_a_simulated_fedavg_round_under_each_option():
  """Grouped FedAvg on the golden run's federation, one round: the server's model of each group under each option
  is that option's statistic (computed here with NumPy) of the models its participants trained, which the plain
  run's client states hold; under 'none' the rows-weighted mean."""
  import jax
  from golden import make_golden_federation
  from fedjax_het.engine import Federation
  plain = make_golden_federation('fedavg')
  start = plain.init()
  after, _ = plain.round(start)
  drawn = plain.participants(0)
  for cfg in (RobustConfig('none'), RobustConfig('median'), RobustConfig('trimmed_mean', trim=0.34),
              RobustConfig('norm_bound', multiplier=0.9)):
    fed = Federation(robust.robust_aggregation(plain.algorithm, cfg), plain.data, plain.models, plain.training,
                     plain.execution, join_ratio=0.5, rounds=2)
    state, metrics = fed.round(fed.init())
    for gi, g in enumerate(fed.groups):
      took = np.isin(g.clients, drawn)
      rows = plain.train_sizes[g.clients][took].astype(np.float64)
      leaves = [jax.tree.leaves(t) for t in (state.server.models[gi], after.groups[gi].params,
                                             start.server.models[gi])]
      for got, trained, before in zip(*leaves):
        x = np.asarray(trained, np.float64)[took]
        if cfg.mode == 'none':
          expected = np.tensordot(rows / rows.sum(), x, axes=1)
        elif cfg.mode == 'median':
          expected = np.median(x, axis=0)
        elif cfg.mode == 'trimmed_mean':
          t = int(np.floor(0.34 * len(x)))
          expected = np.sort(x, axis=0)[t:len(x) - t].mean(0)
        else:
          deltas = [np.concatenate([np.ravel(np.asarray(a, np.float64)[i] - np.asarray(b))
                                    for a, b in zip(jax.tree.leaves(after.groups[gi].params),
                                                    jax.tree.leaves(start.server.models[gi]))])
                    for i in np.flatnonzero(took)]
          norms = np.array([np.linalg.norm(d) for d in deltas])
          factor = np.minimum(1.0, 0.9 * np.median(norms) / norms)
          expected = np.tensordot(rows / rows.sum(), np.asarray(before) + (x - np.asarray(before)) *
                                  factor.reshape((-1,) + (1,) * (x.ndim - 1)), axes=1)
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-6, err_msg=f'{cfg.mode} group {gi}')
    if cfg.mode == 'norm_bound':
      assert metrics['robust_clipped'] >= 1
