import os
import platform
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import compilations, tree_allclose
from fedjax_het.core import Uploads
from fedjax_het.data.federated import ClientArrays
from fedjax_het.engine import (ExecutionConfig, Federation, LocalTraining, ModelConfig, batch_schedule, run_client)
from fedjax_het.engine.groups import host_copy
from fedjax_het.errors import ConfigError
from fedjax_het.kernels import onednn
from fedjax_het.methods import FedREConfig, fedavg_grouped, fedre, local
from fedjax_het.methods.fedavg import GroupModel, GroupModels
from fedjax_het.uploads import RoundUploads

TRAINING = LocalTraining(learning_rate=0.05, batch_size=8, epochs=2)


def make_fed(data, strategy, algorithm=None, join_ratio=1.0, seed=0, models=('small_cnn_narrow', 'mlp'),
             conv='xla', eval_batch_size=16, training=TRAINING, **kw):
  algorithm = algorithm or fedre(FedREConfig(), data.num_classes)
  execution = {k: kw.pop(k) for k in ('chunk_size', 'client_threads', 'scan_unroll', 'onednn_threads',
                                      'memory_budget', 'stream_clients', 'group_threads') if k in kw}
  return Federation(algorithm, data, ModelConfig(list(models), feature_dim=16), training,
                    ExecutionConfig(strategy=strategy, conv=conv, eval_batch_size=eval_batch_size, **execution),
                    join_ratio=join_ratio, seed=seed, **kw)


def run(fed, rounds):
  state = fed.init()
  history = []
  for _ in range(rounds):
    state, m = fed.round(state)
    m.update(fed.evaluate(state))
    history.append(m)
  return state, history


def test_shuffled_batch_schedule_is_a_drop_last_epoch_of_real_rows():
  idx, valid = batch_schedule(jax.random.PRNGKey(0), jnp.asarray(21), n_max=40, batch_size=4, epochs=2,
                              order='shuffle')
  idx, valid = np.asarray(idx).reshape(2, 10, 4), np.asarray(valid).reshape(2, 10)
  assert valid.sum(1).tolist() == [5, 5]  # 21 // 4
  for e in range(2):
    used = idx[e][valid[e]].ravel()
    assert len(set(used)) == 20 and used.max() < 21  # no repeats, never a padding row
  assert not np.array_equal(idx[0], idx[1])          # reshuffled each epoch


def test_stored_order_visits_the_first_rows_in_order_every_epoch():
  """HtFLlib's DataLoader(shuffle=False, drop_last=True): rows 0..B*floor(n/B)-1 in stored order, each epoch."""
  idx, valid = batch_schedule(jax.random.PRNGKey(0), jnp.asarray(21), n_max=40, batch_size=4, epochs=2)
  idx, valid = np.asarray(idx).reshape(2, 10, 4), np.asarray(valid).reshape(2, 10)
  for e in range(2):
    np.testing.assert_array_equal(idx[e][valid[e]].ravel(), np.arange(20))
  training = LocalTraining(batch_size=4)
  assert np.asarray(training.statistics_rows(jnp.asarray([21, 20, 3]))).tolist() == [20, 20, 3]
  assert np.asarray(LocalTraining(batch_size=4, order='shuffle').statistics_rows(jnp.asarray(21))) == 21
  with pytest.raises(ConfigError, match=r"LocalTraining.order='random'"):
    LocalTraining(order='random')


def test_stored_order_statistics_pass_leaves_out_the_last_partial_batch(tiny_data):
  """FedAllRep uploads one weighted row per training row: under the stored order exactly the first
  B*floor(n/B) rows carry weight (HtFLlib's drop_last train loader), under 'shuffle' all n."""
  alg = fedre(FedREConfig(all_representations=True), tiny_data.num_classes)
  for order in ('stored', 'shuffle'):
    training = LocalTraining(learning_rate=0.05, batch_size=8, epochs=1, order=order)
    fed = Federation(alg, tiny_data, ModelConfig(['mlp'], feature_dim=16), training,
                     ExecutionConfig(strategy='vmap', eval_batch_size=16))
    g = fed.groups[0]
    state = fed.init()
    rngs = jax.vmap(lambda c: jax.random.fold_in(jax.random.PRNGKey(5), c))(jnp.asarray(g.clients))
    update = lambda c, d, k: run_client(fed.programs[0][0], g.model, c, d, fed.broadcast(state.server, 0, 0), k, 16)
    _, upload, _ = jax.jit(jax.vmap(update))(state.groups[0], g.train, rngs)
    n = np.asarray(g.train.n)
    expected = n // 8 * 8 if order == 'stored' else n
    np.testing.assert_array_equal(np.asarray(upload.weight).sum(1), expected)


@pytest.mark.slow  # the rounds' vmap == sequential: test_vmap_and_sequential_strategies_agree
def test_vmapped_group_equals_per_client_loop(tiny_data):
  fed = make_fed(tiny_data, 'vmap')
  state = fed.init()
  g = fed.groups[0]
  broadcast = fed.broadcast(state.server, 0, 0)
  rngs = jax.vmap(lambda c: jax.random.fold_in(jax.random.PRNGKey(5), c))(jnp.asarray(g.clients))
  update = lambda c, d, k: run_client(fed.programs[0][0], g.model, c, d, broadcast, k, 16)
  batched = jax.jit(jax.vmap(update))(state.groups[0], g.train, rngs)
  for i in range(g.size):
    take = lambda t: jax.tree.map(lambda a: a[i], t)
    single = jax.jit(update)(take(state.groups[0]), take(g.train), rngs[i])
    tree_allclose(take(batched), single, rtol=2e-5, atol=2e-6)


def test_padding_rows_never_change_a_client_update(tiny_data):
  fed = make_fed(tiny_data, 'vmap')
  state = fed.init()
  g = fed.groups[1]
  client = jax.tree.map(lambda a: a[0], state.groups[1])
  data = jax.tree.map(lambda a: a[0], g.train)
  extra = 37
  padded = ClientArrays(jnp.concatenate([data.x, jnp.full((extra,) + data.x.shape[1:], 7.0)]),
                        jnp.concatenate([data.y, jnp.ones(extra, jnp.int32)]), data.n)
  broadcast = fed.broadcast(state.server, 1, 0)
  for alg in [fedre(FedREConfig(mechanism=m), 4) for m in ('rap', 'rar', 'rsr')]:
    program = alg.phases[0].client(g.spec)
    update = lambda d: run_client(program, g.model, client, d, broadcast, jax.random.PRNGKey(1), 16)
    a, up_a, loss_a = jax.jit(update)(data)
    b, up_b, loss_b = jax.jit(update)(padded)
    tree_allclose(a, b, rtol=1e-5, atol=1e-6)
    tree_allclose(up_a, up_b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-5)


@pytest.fixture(scope='module')
def two_rounds(tiny_data):
  """Two rounds under each strategy with the defaults of make_fed (full participation, xla, eval passes of 16),
  shared by the tests that compare another setting against them."""
  return {strategy: run(make_fed(tiny_data, strategy), 2) for strategy in ('vmap', 'sequential')}


def assert_same_run(a, b, exact_accuracy=True, **tol):
  (s_a, h_a), (s_b, h_b) = a, b
  tree_allclose(s_a, s_b, **tol)
  for x, y in zip(h_a, h_b):
    if exact_accuracy:
      assert x['accuracy'] == y['accuracy'] and x['client_accuracy'] == y['client_accuracy']
    else:
      assert x['accuracy'] == pytest.approx(y['accuracy'], abs=1e-9)
    assert x['train_loss'] == pytest.approx(y['train_loss'], rel=1e-4)


# (0.5, 'xla') is every method's golden vmap test (tests/test_golden.py).
def test_vmap_and_sequential_strategies_agree(two_rounds):
  assert_same_run(two_rounds['vmap'], two_rounds['sequential'], exact_accuracy=False, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_vmap_and_sequential_strategies_agree_with_partial_participation_and_im2col(tiny_data):
  assert_same_run(run(make_fed(tiny_data, 'vmap', join_ratio=0.5, conv='im2col'), 2),
                  run(make_fed(tiny_data, 'sequential', join_ratio=0.5, conv='im2col'), 2), exact_accuracy=False,
                  rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('strategy', ['sequential', pytest.param('vmap', marks=pytest.mark.slow)])
def test_eval_pass_size_does_not_change_results(tiny_data, two_rounds, strategy):
  # 5 rows per pass splits every client's rows into several passes, the last one clamped onto earlier rows.
  assert_same_run(run(make_fed(tiny_data, strategy, eval_batch_size=5), 2), two_rounds[strategy], rtol=1e-5,
                  atol=1e-6)


def test_chunked_vmap_equals_whole_group(tiny_data, two_rounds):
  assert_same_run(run(make_fed(tiny_data, 'vmap', chunk_size=2), 2), two_rounds['vmap'], rtol=1e-5, atol=1e-6)


# One group of 6 clients (the tiny data's), so that a round's chunks can be 4 wide.
ONE_GROUP = dict(models=('mlp',), training=LocalTraining(learning_rate=0.05, batch_size=8, epochs=1))


@pytest.fixture
def peaks(monkeypatch):
  """The peaks XLA's memory analysis gives the executor's budget calls, in the order it asks for them."""
  from fedjax_het.engine import vmap_executor
  recorded = []
  analysed = vmap_executor.compiled_peak
  monkeypatch.setattr(vmap_executor, 'compiled_peak', lambda lowered: recorded.append(analysed(lowered)) or recorded[-1])
  return recorded


def test_the_memory_budget_picks_the_widest_chunk_that_fits_and_changes_no_number(tiny_data, peaks):
  """One group of 6: the budget's width comes from XLA's analysis of the call at widths 1 and 4; a budget between
  their peaks gives chunks of one client, the same numbers as chunks of four; one below the narrowest call's peak
  is refused with its fix; the same budget always gives the same width."""
  one_group = ONE_GROUP
  wide_fed = make_fed(tiny_data, 'vmap', memory_budget=2**40, **one_group)
  wide = run(wide_fed, 1)
  assert len(peaks) == 2 and peaks[1] > peaks[0]  # the call over 4 clients needs more than over 1
  assert wide_fed.executor.widest == {(0, 0): 256} and {c.width for c in wide_fed.executor.last_plan[
      ('train', 0)][1]} == {4, 1}
  budget = (peaks[0] + peaks[1]) // 2
  narrow_fed = make_fed(tiny_data, 'vmap', memory_budget=budget, **one_group)
  narrow = run(narrow_fed, 1)
  assert narrow_fed.executor.widest == {(0, 0): 1}
  assert {c.width for c in narrow_fed.executor.last_plan[('train', 0)][1]} == {1}
  assert_same_run(narrow, wide, exact_accuracy=False, rtol=1e-5, atol=1e-6)
  again = make_fed(tiny_data, 'vmap', memory_budget=budget, **one_group)
  again.round(again.init())
  assert again.executor.widest == narrow_fed.executor.widest and peaks[2:4] == peaks[4:6]
  with pytest.raises(ConfigError, match=r"^ExecutionConfig.memory_budget=[\d.e-]+ GiB \(\d+ bytes\): a round of group "
                                        r"'mlp' needs [\d.e-]+ GiB \(\d+ bytes\) .* Fix: a larger "
                                        r"ExecutionConfig.memory_budget"):
    tight = make_fed(tiny_data, 'vmap', memory_budget=peaks[0] // 2, **one_group)
    tight.round(tight.init())


def test_each_chunk_width_compiles_once_and_a_group_of_one_client_only_at_width_one(tiny_data, peaks):
  """A group of 5 clients and one of 1: the memory analysis compiles the 5-client group's update at widths 1 and 4
  and the 1-client group's at width 1 alone (no call of it is wider), and the round's calls reuse those
  executables: three compilations of the update in all, none in the next round."""
  with compilations() as compiled:
    fed = make_fed(tiny_data, 'vmap', memory_budget=2**40, models=('mlp',) * 5 + ('small_cnn_narrow',),
                   training=ONE_GROUP['training'])
    state = fed.round(fed.init())[0]
    first = [name for name in compiled if name == 'jit(update)']
    fed.round(state)
  assert [g.size for g in fed.groups] == [5, 1]
  assert fed.executor.analysis[0]['widths'] == (1, 4) and fed.executor.analysis[1]['widths'] == (1,)
  assert len(peaks) == 3
  assert len(first) == 3 and compiled.count('jit(update)') == 3


def test_host_copy_compiles_one_program_whatever_the_leaf_shapes():
  """A client's host copy (each group's initial state, Flower's nodes) compiles the take of the client and nothing
  per leaf: `jnp.asarray` of a NumPy array would compile a program per leaf shape, over a hundred in a cold start
  of ten architectures."""
  stacked = {f'w{k}': jnp.arange(2.0 * k * 17).reshape(2, k, 17) + k for k in range(3, 9)}  # 6 leaf shapes
  with compilations() as compiled:
    client = host_copy(stacked, 1)
  assert compiled == ['jit(take_client)']
  for name, leaf in client.items():
    np.testing.assert_array_equal(leaf, stacked[name][1])
    assert isinstance(leaf, jax.Array) and not leaf.committed


def test_a_second_federation_of_the_same_architectures_traces_no_initialiser_and_stacks_uploads_at_once():
  """The classifiers' initialisers are made once per (maker, model, image shape) in a process: a second federation
  of the same models compiles none (and FedAvg, without client state of its own, no program for it), and a third
  starts from the first's parameters. A sequential round stacks its slots' uploads in one program, not one per leaf
  shape."""
  from golden import make_golden_federation
  first_params = jax.device_get(make_golden_federation('fedavg').init().groups[0].params)
  second = make_golden_federation('fedavg')
  with compilations() as compiled:
    state = second.init()
    assert compiled == [], compiled
    second.round(state)
  assert compiled.count('jit(stack_slots)') == 2, compiled  # per group
  assert 'jit(stack)' not in compiled
  tree_allclose(jax.device_get(make_golden_federation('fedavg').init().groups[0].params), first_params, rtol=0,
                atol=0)


def test_same_seed_same_numbers_whatever_the_client_and_group_threads(tiny_data):
  strip = lambda h: [{k: v for k, v in m.items() if 'seconds' not in k} for m in h]
  s1, h1 = run(make_fed(tiny_data, 'sequential', join_ratio=0.5, seed=4, client_threads=1, group_threads=1), 2)
  threaded = make_fed(tiny_data, 'sequential', join_ratio=0.5, seed=4, client_threads=3, group_threads=2)
  ran_in = []
  original = threaded.executor.run
  threaded.executor.run = lambda *a: ran_in.append(threading.current_thread().name) or original(*a)
  s2, h2 = run(threaded, 2)
  _, h3 = run(make_fed(tiny_data, 'sequential', join_ratio=0.5, seed=5), 2)
  tree_allclose(s1, s2, rtol=0, atol=0)
  assert strip(h1) == strip(h2)
  assert strip(h1) != strip(h3)
  # The first round, where the groups' programs compile, runs its two groups in threads of their own; later
  # rounds one after the other from the caller's thread.
  assert [name.startswith('group') for name in ran_in] == [True, True, False, False]
  with pytest.raises(ConfigError, match=r'^ExecutionConfig.group_threads=0 must be >= 1'):
    ExecutionConfig(group_threads=0)


@pytest.mark.skipif(not (sys.platform == 'linux' and platform.machine() == 'x86_64'),
                    reason="the onednn extra installs on Linux x86-64 only")
def test_the_backend_defaults_are_decided_once_and_described(monkeypatch):
  cpu = ExecutionConfig(client_threads=2).resolve('cpu')  # oneDNN is installed with the test extra
  assert (cpu.strategy, cpu.conv, cpu.eval_batch_size) == ('sequential', 'onednn', 64)
  threads = max(1, os.cpu_count() // 2)  # the cores divided among the client threads
  assert cpu.onednn_threads == threads
  assert ExecutionConfig(client_threads=1).resolve('cpu').onednn_threads == os.cpu_count()
  assert ExecutionConfig(client_threads=3, onednn_threads=1).resolve('cpu').onednn_threads == 1
  # No group of two clients: no two clients run at once, so each convolution takes every core.
  assert ExecutionConfig(client_threads=2).resolve('cpu', largest_group=1).onednn_threads == os.cpu_count()
  assert ExecutionConfig(client_threads=2).resolve('cpu', largest_group=3).onednn_threads == threads
  with pytest.raises(ConfigError, match=rf"^ExecutionConfig.onednn_threads=100000 is more than this machine's "
                                        rf"{os.cpu_count()} cores .* Fix: at most {os.cpu_count()}"):
    ExecutionConfig(onednn_threads=100000)
  assert cpu.describe('cpu').endswith(f': strategy=sequential, conv=onednn (oneDNN {onednn.version()}, {threads} '
                                      f'thread{"s" if threads > 1 else ""} each), eval_batch_size=64, client_threads=2')
  gpu = ExecutionConfig(chunk_size=4).resolve('gpu')  # im2col: XLA's grouped convolutions are slow on GPUs
  # A group of one client keeps XLA's convolution (ungrouped under vmap: cuDNN's) unless conv is given.
  assert gpu.describe('gpu').endswith(': strategy=vmap, conv=im2col (xla in groups of one client), '
                                      'eval_batch_size=256, chunk_size=4, devices=1')
  assert ExecutionConfig(conv='im2col').resolve('gpu').single_client_conv == 'im2col'
  assert cpu.single_client_conv == 'onednn'
  assert ExecutionConfig().resolve('tpu').conv == 'xla'  # not measured there
  vmap = ExecutionConfig(strategy='vmap', client_threads=3).resolve('cpu')  # one host thread: every core per call
  assert (vmap.conv, vmap.onednn_threads) == ('onednn', os.cpu_count())
  with pytest.raises(ConfigError, match="^ExecutionConfig.conv='onednn' runs on the CPU only.*Fix: conv='xla'"):
    ExecutionConfig(conv='onednn').resolve('gpu')
  # Without oneDNN: 'auto', and the run's first line says what would be faster; asking for it says why not.
  monkeypatch.setattr(onednn, 'unavailable_reason', lambda: 'oneDNN 3.x was not found. Fix: pip install it.')
  cpu = ExecutionConfig(client_threads=2).resolve('cpu')
  assert (cpu.conv, cpu.eval_batch_size) == ('auto', 32)
  assert f"conv=auto (oneDNN's convolutions would be faster: {onednn.INSTALL})" in cpu.describe('cpu')
  assert ExecutionConfig(strategy='vmap').resolve('cpu').conv == 'im2col'
  with pytest.raises(ConfigError, match="^ExecutionConfig.conv='onednn': oneDNN 3.x was not found. Fix: pip"):
    ExecutionConfig(conv='onednn').resolve('cpu')


def test_a_federation_of_one_client_per_architecture_gives_each_onednn_convolution_every_core():
  from fedjax_het.data import make_federated_data, make_synthetic
  data = make_federated_data(make_synthetic(num_samples=40, image_shape=(8, 8, 1), num_classes=4, seed=1),
                             num_clients=2, partition='iid', seed=0)
  one_each = Federation(fedre(FedREConfig(), 4), data, ModelConfig(('mlp', 'small_cnn_narrow'), feature_dim=16),
                        TRAINING, ExecutionConfig(strategy='sequential', client_threads=2))
  shared = Federation(fedre(FedREConfig(), 4), data, ModelConfig(('mlp',), feature_dim=16), TRAINING,
                      ExecutionConfig(strategy='sequential', client_threads=2))
  cores = os.cpu_count()
  assert (one_each.execution.onednn_threads, shared.execution.onednn_threads) == (cores, max(1, cores // 2))


def test_a_group_of_one_client_is_built_with_its_own_convolution(tiny_data):
  from fedjax_het.engine.groups import build_groups
  groups = build_groups(tiny_data, ModelConfig(('mlp',) * 5 + ('small_cnn_narrow',), feature_dim=16), TRAINING,
                        'im2col', 1, None, single_client_conv='xla')
  assert [(g.size, g.spec.conv, g.spec.maker.conv) for g in groups] == [(5, 'im2col', 'im2col'), (1, 'xla', 'xla')]


def test_training_improves_accuracy(tiny_data):
  # PyTorch's default initialisation starts small (variance 1/(3 fan_in)): a larger rate learns in 4 rounds.
  _, history = run(make_fed(tiny_data, 'sequential', training=LocalTraining(0.2, 8, 2)), 4)
  assert history[-1]['local_head_accuracy'] > 0.7  # 4 classes: chance is about 0.25


@pytest.mark.parametrize('strategy', ['vmap', 'sequential'])
def test_a_first_round_compiles_no_copy_of_a_host_value_and_later_rounds_nothing(tiny_data, strategy):
  """A round builds its inputs (slot indices, step counts, buffers, empty uploads) on the host and moves them with
  `jax.device_put`: `jnp.asarray` of a NumPy array compiles a copy program ('stage', 'convert_element_type') per
  shape and dtype, `jnp.zeros` a 'broadcast_in_dim', and a federation paid one compilation for each. After its
  first round, a federation compiles nothing, whoever participates."""
  fed = make_fed(tiny_data, strategy, join_ratio=0.5)
  state = fed.init()
  jax.clear_caches()  # what earlier tests compiled in this process would hide a copy program
  with compilations() as first:
    state, _ = fed.round(state)
    fed.evaluate(state)
  assert first and not {'jit(stage)', 'jit(convert_element_type)', 'jit(broadcast_in_dim)'} & set(first), first
  with compilations() as compiles:
    for _ in range(3):  # different participants every round
      state, _ = fed.round(state)
      fed.evaluate(state)
  assert compiles == []


def test_grouped_fedavg_server_is_the_sample_weighted_mean_of_participants_per_group():
  alg = fedavg_grouped(2)
  models = ({'w': jnp.zeros(2)}, {'w': jnp.full(3, 9.)})
  uploads = (Uploads(GroupModel({'w': jnp.array([[1., 1.], [3., 5.], [100., 100.]])}), jnp.array([True, True, False]),
                     jnp.array([1., 3., 50.])),
             Uploads(GroupModel({'w': jnp.ones((1, 3))}), jnp.array([False]), jnp.array([4.])))
  server, _ = alg.phases[0].server_update(GroupModels(models), RoundUploads(uploads), jax.random.PRNGKey(0))
  np.testing.assert_allclose(server.models[0]['w'], [2.5, 4.0])  # (1*1 + 3*3)/4, (1*1 + 3*5)/4
  np.testing.assert_allclose(server.models[1]['w'], [9., 9., 9.])  # no participant: kept


def test_grouped_fedavg_scores_every_member_with_its_group_model(tiny_data):
  fed = make_fed(tiny_data, 'sequential', algorithm=fedavg_grouped(4))
  state, history = run(fed, 1)
  for gi, stacked in enumerate(state.groups):
    weights = fed.groups[gi].train_sizes / fed.groups[gi].train_sizes.sum()
    expected = jax.tree.map(lambda a: np.tensordot(weights, np.asarray(a), 1), stacked.params)
    tree_allclose(state.server.models[gi], expected, rtol=1e-5, atol=1e-6)
  params = sum(g.num_params for g in fed.groups for _ in g.clients)
  assert history[0]['upload_scalars'] == history[0]['broadcast_scalars'] == params


def test_local_communicates_nothing(tiny_data):
  _, history = run(make_fed(tiny_data, 'sequential', algorithm=local(4)), 1)
  assert history[0]['upload_scalars'] == 0 and history[0]['broadcast_scalars'] == 0


def test_bad_engine_arguments(tiny_data):
  with pytest.raises(ConfigError, match=r"ExecutionConfig.strategy='pmap'"):
    make_fed(tiny_data, 'pmap')
  with pytest.raises(ConfigError, match='Federation.join_ratio'):
    make_fed(tiny_data, 'vmap', join_ratio=0.0)
  with pytest.raises(ConfigError, match="^ModelConfig.names: unknown model 'resnet9000'"):
    make_fed(tiny_data, 'vmap', models=('resnet9000',))
  with pytest.raises(ConfigError, match='ExecutionConfig.eval_batch_size=-1'):
    make_fed(tiny_data, 'vmap', eval_batch_size=-1)
  assert make_fed(tiny_data, 'sequential', eval_batch_size=None).executor.eval_batch_size == 32  # CPU, xla


def test_global_protocol_scores_every_client_on_the_shared_test_set_and_its_local_split():
  from fedjax_het.data import make_federated_data, make_synthetic
  ds = make_synthetic(num_samples=240, image_shape=(8, 8, 1), num_classes=4, noise=0.3, seed=2)
  data = make_federated_data(ds, num_clients=4, partition='iid', seed=0, protocol='global', train_fraction=0.75)
  results = [run(make_fed(data, s), 1)[1][-1] for s in ('vmap', 'sequential')]
  for key in ('accuracy', 'local_test_accuracy', 'local_test_client_accuracy_mean'):
    assert key in results[0]
    assert results[0][key] == pytest.approx(results[1][key], abs=1e-9)
  # Every client is scored on all test rows: sample-weighted accuracy is the mean of client accuracies.
  assert results[0]['accuracy'] == pytest.approx(np.mean(results[0]['client_accuracy']))
  with pytest.raises(ConfigError, match='make_federated_data.train_fraction'):
    make_fed(make_federated_data(ds, 4, 'iid', seed=0, protocol='pooled', train_fraction=1.0), 'vmap')


def staged_algorithm():
  """A program of three stages that records what each one saw: steps of generated stages (and the sum of their
  keys' first words, so both strategies must draw the same keys), real steps and the real rows' label sum."""
  from fedjax_het.core import ClientProgram, Stage
  from fedjax_het.methods.shared.base import local_head_evaluation, no_server, one_phase

  def generated(carry, batch, broadcast, key):
    assert batch.x is None and batch.index is None
    return {**carry, 'gen': carry['gen'] + 1, 'keys': carry['keys'] + jax.random.uniform(key)}, 1.0

  def real(carry, batch, broadcast, key):
    return {**carry, 'real': carry['real'] + 1, 'labels': carry['labels'] + batch.y.sum()}, 3.0

  def client(group):
    zero = {'gen': 0, 'real': 0, 'labels': 0, 'keys': 0.0}
    training = LocalTraining(batch_size=8, epochs=99)  # ignored: the stages set the epochs
    return ClientProgram(lambda c, b, k: (c, zero),
                         (Stage(lambda c, *a: (lambda r: ((c[0], r[0]), r[1]))(generated(c[1], *a)), 2, True),
                          Stage(lambda c, *a: (lambda r: ((c[0], r[0]), r[1]))(real(c[1], *a)), 1),
                          Stage(lambda c, *a: (lambda r: ((c[0], r[0]), r[1]))(generated(c[1], *a)), 1, True)),
                         lambda carry, rows, b, k: (carry[0], carry[1]), training)

  def server_update(server, uploads, key):
    return {'seen': uploads[0].values}, {}
  return one_phase('staged', no_server, client, server_update, local_head_evaluation)


def test_stages_run_in_order_with_their_own_step_counts_under_both_strategies(tiny_data):
  """Generated stages take max(1, n // B) steps per epoch, real ones n // B drop_last batches of real rows; the
  vmap executor (padded slots masked) and the sequential one run the same steps with the same keys."""
  out = {}
  for strategy in ('vmap', 'sequential'):
    fed = make_fed(tiny_data, strategy, algorithm=staged_algorithm(), models=('mlp',))
    state, metrics = fed.round(fed.init())
    g = fed.groups[0]
    out[strategy] = {k: np.asarray(v)[:g.size] for k, v in state.server['seen'].items()}, metrics['local_steps']
  sizes = np.asarray(g.train_sizes)
  (v, v_steps), (s, s_steps) = out['vmap'], out['sequential']
  np.testing.assert_array_equal(v['gen'], 3 * np.maximum(1, sizes // 8))
  np.testing.assert_array_equal(v['real'], sizes // 8)
  for k in ('gen', 'real', 'labels'):
    np.testing.assert_array_equal(v[k], s[k])
  np.testing.assert_allclose(v['keys'], s['keys'], rtol=1e-6)
  assert v_steps == s_steps == int((3 * np.maximum(1, sizes // 8) + sizes // 8).sum())


def test_clients_streamed_from_the_host_give_the_numbers_of_resident_ones(tiny_data):
  """Client states and rows on the host, each chunk's copied to the device and back: the same rounds, evaluations
  and states as with everything on the device; the state the round was given is left as it was."""
  one_group = ONE_GROUP
  resident = run(make_fed(tiny_data, 'vmap', **one_group), 2)
  streamed_fed = make_fed(tiny_data, 'vmap', stream_clients=True, **one_group)
  streamed = run(streamed_fed, 2)
  assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(streamed[0].groups))  # on the host
  assert_same_run(streamed, resident, exact_accuracy=False, rtol=1e-5, atol=1e-6)
  before = streamed[0]
  kept = jax.tree.map(np.copy, before.groups)
  streamed_fed.round(before)
  tree_allclose(before.groups, kept, rtol=0, atol=0)


@pytest.mark.slow  # streaming's numbers: test_clients_streamed_from_the_host_give_the_numbers_of_resident_ones
def test_a_population_larger_than_the_memory_budget_runs_with_clients_streamed(tiny_data, peaks):
  """A budget below the group's client states: refused with everything on the device, while streamed chunks fit
  it and give the same numbers."""
  from fedjax_het.engine.stores import nbytes
  one_group = ONE_GROUP
  resident_fed = make_fed(tiny_data, 'vmap', memory_budget=2**40, **one_group)
  resident = run(resident_fed, 1)
  resident_peak = peaks[0]  # one client per call, the population's states and rows its arguments
  run(make_fed(tiny_data, 'vmap', memory_budget=2**40, stream_clients=True, **one_group), 1)
  streamed_peak = peaks[2]  # one client per call, only its own state and rows
  population = nbytes(resident[0].groups)
  budget = (streamed_peak + resident_peak) // 2
  assert streamed_peak < budget < population  # the clients' states alone do not fit the budget
  with pytest.raises(ConfigError, match=r'^ExecutionConfig.memory_budget='):
    tight = make_fed(tiny_data, 'vmap', memory_budget=budget, **one_group)
    tight.round(tight.init())
  streamed = run(make_fed(tiny_data, 'vmap', memory_budget=budget, stream_clients=True, **one_group), 1)
  assert_same_run(streamed, resident, exact_accuracy=False, rtol=1e-5, atol=1e-6)
