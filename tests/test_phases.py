"""The engine-v2 shape, proven by a method the old API could not express (tests/cgan_method.py): per-client
generator and discriminator with Adam states kept across rounds, a D step then a G step per batch, the generator
averaged over all groups while classifiers average within their group, and a second phase on generated batches.
"""

import jax
import numpy as np
import pytest

from cgan_method import cgan
from conftest import tree_allclose
from runs import record_rounds, run_rounds
from fedjax_het.engine import ExecutionConfig, Federation, LocalTraining, ModelConfig
from fedjax_het.run.checkpoints import Checkpoints

ROUNDS = 4  # 2 GAN rounds, then 2 rounds on generated batches


def make(data, strategy='sequential', join_ratio=0.5):
  return Federation(cgan(data.num_classes), data, ModelConfig(['small_cnn_narrow', 'mlp'], feature_dim=16),
                    LocalTraining(0.05, 8, 1), ExecutionConfig(strategy=strategy, conv='xla', eval_batch_size=16),
                    join_ratio=join_ratio, rounds=ROUNDS)


@pytest.fixture(scope='module')
def recorded(tiny_data):
  """The sequential run, every round's state and compilations kept."""
  fed = make(tiny_data)
  return record_rounds(fed, fed.init(), ROUNDS)


@pytest.fixture(scope='module')
def uninterrupted(recorded):
  return recorded.states[-1], recorded.history


@pytest.fixture(scope='module')
def recorded_vmap(tiny_data):
  fed = make(tiny_data, 'vmap')
  return record_rounds(fed, fed.init(), ROUNDS)


def test_phases_run_in_order_and_the_round_counter_continues(uninterrupted):
  _, history = uninterrupted
  assert [m['phase'] for m in history] == ['gan', 'gan', 'synthetic', 'synthetic']
  assert [m['round'] for m in history] == [1, 2, 3, 4]
  assert all(np.isfinite(m['train_loss']) and 0 <= m['accuracy'] <= 1 for m in history)
  # The generator crosses in the GAN phase only; the group's classifier always.
  assert history[0]['upload_generator_scalars'] > 0 and 'upload_generator_scalars' not in history[2]
  assert history[2]['upload_classifier_scalars'] > 0


def test_adam_states_persist_across_rounds_and_the_generator_is_averaged_over_all_groups(tiny_data):
  fed = make(tiny_data, join_ratio=1.0)
  state = fed.init()
  state, _ = fed.round(state)
  count = lambda st: [int(np.asarray(jax.tree.leaves(g.extra['gen_opt'])[0])[0]) for g in st.groups]
  steps = [int(fed.groups[gi].train_sizes[0]) // 8 for gi in range(2)]
  assert count(state) == steps  # Adam's step counter of client 0 of each group: its local steps of round 1
  gens = jax.tree.map(lambda *a: np.concatenate(a), *[g.extra['gen'] for g in state.groups])
  tree_allclose(state.server['generator'], jax.tree.map(lambda a: a.mean(0), gens), rtol=1e-5, atol=1e-6)
  for gi, g in enumerate(state.groups):  # classifiers: the sample-weighted mean within the group
    w = fed.groups[gi].train_sizes / fed.groups[gi].train_sizes.sum()
    tree_allclose(state.server['classifiers'][gi], jax.tree.map(lambda a: np.tensordot(w, np.asarray(a), 1),
                                                                g.params), rtol=1e-5, atol=1e-6)
  state, _ = fed.round(state)
  assert count(state) == [2 * s for s in steps]  # kept, not rebuilt: two rounds of steps


# The vmap run is made for the no-recompilation check by default; comparing it costs nothing more.
def test_vmap_executor_equals_sequential(recorded_vmap, uninterrupted):
  state, history = recorded_vmap.states[-1], recorded_vmap.history
  tree_allclose(state.groups, uninterrupted[0].groups, rtol=2e-4, atol=2e-5)
  tree_allclose(state.server, uninterrupted[0].server, rtol=2e-4, atol=2e-5)
  for a, b in zip(history, uninterrupted[1]):
    assert a['accuracy'] == pytest.approx(b['accuracy'], abs=1e-9)
    assert a['train_loss'] == pytest.approx(b['train_loss'], rel=1e-4)


@pytest.fixture(scope='module')
def fresh(tiny_data):
  """A second federation of the same run, as a resumed process builds it (shared by the resume cases)."""
  return make(tiny_data)


@pytest.mark.parametrize('stop', [2, 3])  # at the phase boundary, inside phase 2
def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(recorded, uninterrupted, fresh, tmp_path, stop):
  checkpoints = Checkpoints(str(tmp_path / 'ckpt'))
  checkpoints.save(recorded.states[stop - 1])
  restored = checkpoints.restore(fresh.init(), checkpoints.latest_round())
  assert int(restored.round) == stop
  state, rest = run_rounds(fresh, restored, ROUNDS - stop)
  tree_allclose(state.groups, uninterrupted[0].groups, rtol=0, atol=0)
  tree_allclose(state.server, uninterrupted[0].server, rtol=0, atol=0)
  assert recorded.history[:stop] + rest == uninterrupted[1]


@pytest.mark.parametrize('strategy', ['sequential', 'vmap'])
def test_no_recompilation_after_each_phases_first_round(request, strategy):
  compiles = request.getfixturevalue('recorded' if strategy == 'sequential' else 'recorded_vmap').compiles
  assert compiles[0] > 0  # the listener hears compilations: the first round compiles its programs
  assert compiles[1] == 0 and compiles[3] == 0, compiles  # the second round of each phase, other participants
