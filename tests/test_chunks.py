"""The vmap executor's chunk plans (engine/chunks.py): hand-worked plans, the invariants of every plan, and the
padding waste of HtFLlib's partitions at 10, 100 and 1,000 clients."""

import numpy as np
import pytest

from fedjax_het.data.partition import partition_clients
from fedjax_het.engine.chunks import padding_waste, plan_chunks, width_ladder


def test_width_ladder():
  assert width_ladder(256) == (256, 64, 16, 4, 1)
  assert width_ladder(100) == (64, 16, 4, 1)  # rounded down to a power of 4
  assert width_ladder(1) == (1,)
  assert width_ladder(256, multiple=2) == (128, 32, 8, 2)  # a 2-device mesh: multiples of 2


def test_a_hand_worked_plan():
  # Sorted: 10, 9, 9, 8 | 1 | 1 | 0. Four wide: 4 * 10 = 40 <= 1.15 * 36; three remain, fewer than four, so
  # ones: 1, 1, 0 (no empty slot).
  chunks = plan_chunks(np.array([1, 10, 0, 9, 8, 1, 9]), max_width=4)
  assert [c.positions.tolist() for c in chunks] == [[1, 3, 6, 4], [0], [5], [2]]
  assert [(c.width, c.work) for c in chunks] == [(4, 10), (1, 1), (1, 1), (1, 0)]
  assert padding_waste(np.array([1, 10, 0, 9, 8, 1, 9]), chunks) == pytest.approx(42 / 38)


def test_a_chunk_never_computes_much_more_than_it_uses():
  # 10 and 4 cannot share a chunk of 4 (4 * 10 > 1.15 * 26), nor can they with the 2s.
  chunks = plan_chunks(np.array([10, 4, 4, 4, 4, 2, 2, 2, 2]), max_width=4)
  assert [(c.width, len(c.positions), c.work) for c in chunks] == [(1, 1, 10), (4, 4, 4), (4, 4, 2)]


def test_a_mesh_gets_widths_of_its_multiple_with_empty_slots_last():
  chunks = plan_chunks(np.array([5, 5, 5]), max_width=4, multiple=2)
  assert [(c.width, len(c.positions)) for c in chunks] == [(2, 2), (2, 1)]


@pytest.mark.parametrize('seed', range(5))
def test_every_participant_runs_once_in_a_ladder_width(seed):
  rng = np.random.RandomState(seed)
  work = rng.randint(0, 50, size=rng.randint(1, 300))
  chunks = plan_chunks(work, max_width=64)
  positions = np.concatenate([c.positions for c in chunks])
  assert sorted(positions.tolist()) == list(range(len(work)))
  assert np.all(np.diff(work[positions]) <= 0)  # largest first
  assert all(c.width in width_ladder(64) and len(c.positions) == c.width for c in chunks)  # no empty slot
  assert all(c.work == work[c.positions].max() for c in chunks)
  assert all(c.width == 1 or c.width * c.work <= 1.15 * work[c.positions].sum() for c in chunks)
  assert [c.positions.tolist() for c in plan_chunks(work, max_width=64)] == [c.positions.tolist() for c in chunks]


@pytest.mark.parametrize('partition', ['iid', 'dirichlet'])
@pytest.mark.parametrize('clients', [10, 100, 1000])
def test_padding_waste_of_reference_partitions_stays_under_15_percent(partition, clients):
  """Computed over useful local steps (batch 32, drop_last) for HtFLlib's splits of a 10-class pool; padding every
  client to the largest, as a single vmapped call does, computes up to several times more."""
  # At 1,000 clients HtFLlib's Dirichlet split needs a larger pool and alpha: with alpha 0.1 some client always
  # stays below its minimum size.
  labels = np.repeat(np.arange(10), 6000 if clients <= 100 else 60000)
  alpha = 0.1 if clients <= 100 else 0.5
  split = partition_clients(labels, clients, partition, seed=0, num_classes=10, alpha=alpha)
  steps = np.array([len(t) // 32 for t in split.train_indices])
  assert padding_waste(steps, plan_chunks(steps, max_width=256)) <= 1.15
