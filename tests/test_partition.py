import math

import numpy as np
import pytest

from fedjax_het.data.partition import (default_least_samples, dirichlet_partition, iid_partition, partition_clients,
                                       pathological_partition, train_test_split)
from fedjax_het.errors import ConfigError


def _labels(per_class, num_classes):
  return np.repeat(np.arange(num_classes), per_class)


def _disjoint_cover(parts, n):
  allidx = np.concatenate(parts)
  assert len(allidx) == n and len(np.unique(allidx)) == n


def test_least_samples_rule():
  assert default_least_samples(60000, 10) == 40            # min(10 / 0.25, 3000)
  assert default_least_samples(1000, 20) == 25             # min(40, 1000 / 20 / 2)


@pytest.mark.parametrize('alpha', [0.05, 0.1, 1.0])
def test_dirichlet_sizes_cap_and_minimum(alpha):
  labels = _labels(300, 10)
  num_clients = 10
  parts = dirichlet_partition(labels, num_clients, alpha, np.random.RandomState(0))
  _disjoint_cover(parts, len(labels))
  assert min(len(p) for p in parts) >= default_least_samples(len(labels), num_clients)
  # The N/K cap: a client that already held >= N/K samples before class c gets none of class c, up to one row:
  # the reference truncates cumsum(p) * n_c, and float rounding (0.99999... * n_c) can leave the last row to it.
  held = np.zeros(num_clients)
  for c in range(10):
    got = np.array([np.sum(labels[p] == c) for p in parts])
    assert np.all(got[held >= len(labels) / num_clients] <= 1)
    held += got


def test_dirichlet_same_seed_same_partition():
  labels = _labels(100, 5)
  a = dirichlet_partition(labels, 5, 0.1, np.random.RandomState(7))
  b = dirichlet_partition(labels, 5, 0.1, np.random.RandomState(7))
  c = dirichlet_partition(labels, 5, 0.1, np.random.RandomState(8))
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_dirichlet_rejects_bad_alpha_and_too_many_clients():
  labels = _labels(10, 3)
  with pytest.raises(ConfigError, match='--alpha'):
    dirichlet_partition(labels, 2, 0.0, np.random.RandomState(0))
  with pytest.raises(ConfigError, match='--num_clients'):
    dirichlet_partition(labels, 40, 0.1, np.random.RandomState(0), least_samples=1)


def test_pathological_balanced_hand_checked():
  # 10 classes x 100 samples, 10 clients, 2 classes each: window = ceil(10/10 * 2) = 2, so classes 2j and 2j+1
  # go to clients 2j and 2j+1, 50 samples each.
  labels = _labels(100, 10)
  parts = pathological_partition(labels, 10, 2, np.random.RandomState(0), balance=True)
  counts = np.stack([np.bincount(labels[p], minlength=10) for p in parts])
  expected = np.zeros((10, 10), int)
  for k in range(10):
    j = 2 * (k // 2)
    expected[k, [j, j + 1]] = 50
  np.testing.assert_array_equal(counts, expected)


def test_pathological_unbalanced_classes_per_client():
  labels = _labels(200, 10)
  parts = pathological_partition(labels, 10, 2, np.random.RandomState(1), balance=False)
  _disjoint_cover(parts, len(labels))
  counts = np.stack([np.bincount(labels[p], minlength=10) for p in parts])
  assert np.all((counts > 0).sum(1) == 2)
  assert len({tuple(c) for c in counts}) > 1  # unbalanced: shares differ
  # When K * cpc / C does not tile, HtFLlib's sliding window leaves the last clients with fewer classes.
  parts = pathological_partition(labels, 20, 3, np.random.RandomState(1), balance=False)
  _disjoint_cover(parts, len(labels))
  classes = [(np.bincount(labels[p], minlength=10) > 0).sum() for p in parts]
  assert max(classes) == 3 and min(classes) < 3  # windows of ceil(20 / 10 * 3) = 6 clients run out at the end


def test_iid_is_balanced_over_all_classes():
  labels = _labels(30, 4)
  parts = iid_partition(labels, 3, np.random.RandomState(0))
  counts = np.stack([np.bincount(labels[p], minlength=4) for p in parts])
  np.testing.assert_array_equal(counts, np.full((3, 4), 10))


def test_train_test_split_sizes():
  parts = [np.arange(0, 10), np.arange(10, 17), np.arange(17, 19)]
  train, test = train_test_split(parts, 0.75, np.random.RandomState(0))
  for p, tr, te in zip(parts, train, test):
    assert len(te) == math.ceil(len(p) * 0.25)
    assert len(tr) + len(te) == len(p)
    assert set(tr) | set(te) == set(p) and not set(tr) & set(te)
  with pytest.raises(ConfigError, match='too few to split'):
    train_test_split([np.arange(1)], 0.75, np.random.RandomState(0))


def test_partition_clients_counts_and_errors():
  labels = _labels(100, 4)
  split = partition_clients(labels, 4, 'dirichlet', seed=0, num_classes=4, alpha=0.3)
  assert split.train_class_counts.sum() + split.test_class_counts.sum() == 400
  with pytest.raises(ConfigError, match='--partition'):
    partition_clients(labels, 4, 'bogus', seed=0, num_classes=4)


def test_long_tail_class_sizes_follow_the_imbalance_factor():
  from fedjax_het.data.partition import long_tail_indices
  labels = _labels(1000, 5)
  kept = long_tail_indices(labels, 5, 100.0, np.random.RandomState(0))
  counts = np.bincount(labels[kept], minlength=5)
  # n_c = floor(1000 * 100^(-c/4)): 1000, 316, 100, 31, 10.
  np.testing.assert_array_equal(counts, [1000, 316, 100, 31, 10])
  split = partition_clients(labels, 4, 'dirichlet', seed=0, num_classes=5, alpha=0.5, imbalance_factor=100.0)
  np.testing.assert_array_equal(split.train_class_counts.sum(0) + split.test_class_counts.sum(0), counts)
  with pytest.raises(ConfigError, match='--imbalance_factor'):
    long_tail_indices(labels, 5, 0.5, np.random.RandomState(0))


def test_partitions_equal_the_reference_for_the_same_seed():
  """HtFLlib/PFLlib's own outputs (tests/fixtures/htfllib_partitions.json, produced by their dataset_utils'
  separate_data and split_data): train and test index lists in content and order, for the Dirichlet and the
  pathological partitions, balanced and not, two seeds each."""
  import json
  import os
  with open(os.path.join(os.path.dirname(__file__), 'fixtures', 'htfllib_partitions.json')) as f:
    fixture = json.load(f)
  labels = np.asarray(fixture['labels'])
  kinds = set()
  for case in fixture['cases']:
    partition = {'dir': 'dirichlet', 'pat': 'pathological'}[case['partition']]
    split = partition_clients(labels, case['num_clients'], partition, case['seed'], case['num_classes'],
                              alpha=case.get('alpha', 0.1), classes_per_client=case.get('class_per_client', 2),
                              balance=case.get('balance', False))
    assert [t.tolist() for t in split.train_indices] == case['train']
    assert [t.tolist() for t in split.test_indices] == case['test']
    kinds.add((partition, case.get('balance')))
  assert kinds == {('dirichlet', None), ('pathological', False), ('pathological', True)}
