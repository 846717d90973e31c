"""The baselines of FedRE's comparison: each one's distinctive computation against hand-computed values, two
rounds of each on tiny data with two architecture groups, and FedRE Table 11's communication figures."""

import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tree_allclose
from golden import client_state, golden_federation
from fedjax_het.core import Uploads, server_step
from fedjax_het.engine import ExecutionConfig, Federation, LocalTraining, ModelConfig
from fedjax_het.errors import ConfigError
from fedjax_het.methods import (FDConfig, FedGenConfig, FedGHConfig, FedProtoConfig, FedREConfig, FedTGPConfig, fedgen,
                                fedgh, fedproto, fedre, fedtgp, lg_fedavg)
from fedjax_het.methods.fd import distillation_term
from fedjax_het.methods.fedproto import PrototypeUpload, Prototypes
from fedjax_het.methods.fedre import FedREUpload
from fedjax_het.methods.fedgen import FedGenServer, FeatureGenerator, ensemble_logits
from fedjax_het.methods.fedtgp import adaptive_margin, margin_contrastive_loss
from fedjax_het.methods.fml import FMLConfig, fml, mutual_loss
from fedjax_het.methods.shared.base import HeadServer, HeadUpload
from fedjax_het.methods.shared.common import nearest_prototype_head, prototype_regularizer, sgd_on_rows
from fedjax_het.methods.shared.common import elementwise_kl
from fedjax_het.uploads import aggregate_class_means
from fedjax_het.uploads import RoundUploads

C, D = 3, 2


def test_class_means_are_averaged_over_the_participants_holding_the_class():
  means = jnp.array([[[1., 1.], [2., 2.], [0., 0.]],
                     [[3., 5.], [0., 0.], [0., 0.]],
                     [[9., 9.], [9., 9.], [9., 9.]]])
  counts = jnp.array([[4, 1, 0], [1, 0, 0], [5, 5, 5]])
  protos, present = aggregate_class_means(means, counts, jnp.array([True, True, False]))  # client 2 absent
  np.testing.assert_allclose(protos, [[2., 3.], [2., 2.], [0., 0.]])  # unweighted: (1+3)/2, (1+5)/2
  assert present.tolist() == [True, True, False]


def test_fedproto_regularizer_is_the_batch_and_d_mean_of_squared_gaps():
  reps = jnp.array([[1., 2.], [3., 3.], [0., 1.]])
  labels = jnp.array([0, 1, 2])
  protos = jnp.array([[0., 0.], [1., 1.], [5., 5.]])
  present = jnp.array([True, True, False])  # class 2 has no global prototype: row 2 adds 0 but counts
  expected = ((1 + 4) + (4 + 4) + 0) / (3 * 2)
  np.testing.assert_allclose(prototype_regularizer(reps, labels, protos, present), expected, rtol=1e-6)


def test_nearest_prototype_head_predicts_the_nearest_present_prototype():
  protos = jnp.array([[0., 0.], [4., 0.], [1., 1.]])
  present = jnp.array([True, True, False])
  head = nearest_prototype_head(protos, present)
  reps = jnp.array([[0.9, 0.9], [3., 0.], [1.9, 0.]])  # nearest present: 0 (class 2 absent), 1, 0
  pred = jnp.argmax(reps @ head['kernel'] + head['bias'], -1)
  assert pred.tolist() == [0, 1, 0]


def test_fedtgp_margin_is_the_largest_nearest_class_gap_capped_at_tau():
  means = jnp.array([[0., 0.], [3., 4.], [0., 1.], [100., 100.]])
  present = jnp.array([True, True, True, False])
  # nearest-other distances: class 0 -> 1 (class 2), class 1 -> sqrt(9+9)=4.243 (class 2), class 2 -> 1
  np.testing.assert_allclose(adaptive_margin(means, present, 100.), math.sqrt(18), rtol=1e-6)
  np.testing.assert_allclose(adaptive_margin(means, present, 2.), 2.)
  np.testing.assert_allclose(adaptive_margin(means, jnp.array([True, False, False, False]), 7.), 7.)


def test_fedtgp_loss_adds_the_margin_to_the_true_class_distance():
  protos = jnp.array([[0., 0.]])
  generated = jnp.array([[3., 4.], [0., 1.]])  # distances 5 and 1
  loss = margin_contrastive_loss(protos, jnp.array([0]), generated, jnp.asarray(2.))
  logits = np.array([-(5. + 2.), -1.])
  np.testing.assert_allclose(loss[0], -(logits[0] - np.log(np.exp(logits).sum())), rtol=1e-6)


def test_fd_target_is_the_softmax_of_the_class_mean_logit():
  logits = jnp.array([[1., 0., 0.], [0., 2., 0.]])
  global_logits = jnp.array([[0., 0., 0.], [0., math.log(2.), math.log(2.)], [0., 0., 0.]])
  present = jnp.array([False, True, True])
  term = distillation_term(logits, jnp.array([0, 1]), global_logits, present)
  target = np.array([0.2, 0.4, 0.4])  # softmax of L_1
  log_p = np.array([0., 2., 0.]) - np.log(np.exp([0., 2., 0.]).sum())
  np.testing.assert_allclose(term, -(target * log_p).sum() / 2, rtol=1e-6)  # row 0 has no global logit


def test_lg_fedavg_server_is_the_sample_weighted_mean_of_participant_heads():
  alg = lg_fedavg(C)
  heads = {'kernel': jnp.stack([jnp.full((D, C), v) for v in (1., 4., 100.)]), 'bias': jnp.array([[1.] * C,
                                                                                                   [4.] * C,
                                                                                                   [100.] * C])}
  uploads = (Uploads(HeadUpload(heads), jnp.array([True, True, False]), jnp.array([30., 10., 50.])),)
  server, _ = alg.phases[0].server_update(HeadServer(jax.tree.map(lambda a: a[0], heads)), RoundUploads(uploads),
                                          jax.random.PRNGKey(0))
  np.testing.assert_allclose(server.head['kernel'], np.full((D, C), (30 * 1 + 10 * 4) / 40))


def test_fedgh_server_is_sgd_on_ce_over_the_uploaded_prototypes():
  cfg = FedGHConfig(server_learning_rate=0.5, server_batch_size=10, server_epochs=1)
  head = {'kernel': jnp.array([[1., 0., -1.], [0., 1., 0.]]), 'bias': jnp.zeros(C)}
  uploads = (Uploads(PrototypeUpload(jnp.array([[[1., 0.], [0., 2.], [0., 0.]]]), jnp.array([[3, 1, 0]])),
                     jnp.array([True]), jnp.ones(1)),)
  spec = SimpleNamespace(training=LocalTraining(0.05, 32))  # the server batch is cfg's 10
  server, _ = server_step(fedgh(cfg, C).phases[0], spec)(HeadServer(head), uploads, jax.random.PRNGKey(0))
  # One batch holds both real rows (class 2 is absent): one step on their mean CE, computed by hand.
  x = np.array([[1., 0.], [0., 2.]])
  p = jax.nn.softmax(x @ np.asarray(head['kernel']), -1)
  grad_logits = (np.asarray(p) - np.eye(C)[[0, 1]]) / 2
  np.testing.assert_allclose(server.head['kernel'], head['kernel'] - 0.5 * x.T @ grad_logits, rtol=1e-5)
  np.testing.assert_allclose(server.head['bias'], -0.5 * grad_logits.sum(0), rtol=1e-5, atol=1e-7)


def test_fedgh_server_batches_are_the_runs_local_batch_size_unless_set():
  """The server's batch comes from the LocalTraining the run trains with (`FederationSpec.training`)."""
  head = {'kernel': jnp.array([[1., 0., -1.], [0., 1., 0.]]), 'bias': jnp.zeros(C)}
  uploads = (Uploads(PrototypeUpload(jnp.array([[[1., 0.], [0., 2.], [0., 0.]]]), jnp.array([[3, 1, 0]])),
                     jnp.array([True]), jnp.ones(1)),)
  def trained(server_batch_size, local_batch_size):
    cfg = FedGHConfig(server_learning_rate=0.5, server_batch_size=server_batch_size, server_epochs=1)
    spec = SimpleNamespace(training=LocalTraining(0.05, local_batch_size))
    return server_step(fedgh(cfg, C).phases[0], spec)(HeadServer(head), uploads, jax.random.PRNGKey(0))[0].head
  one_by_one = trained(1, 32)
  tree_allclose(trained(None, 1), one_by_one)
  assert not np.allclose(trained(None, 2)['kernel'], one_by_one['kernel'])


def test_fedgen_ensemble_is_the_weighted_sum_of_head_logits():
  heads = {'kernel': jnp.array([[[1., 0.], [0., 1.]], [[0., 2.], [2., 0.]]]), 'bias': jnp.array([[0., 1.], [1., 0.]])}
  z = jnp.array([[1., 3.]])
  # head 0: [1, 3] + [0, 1] = [1, 4]; head 1: [6, 2] + [1, 0] = [7, 2]; weights 0.25 / 0.75.
  np.testing.assert_allclose(ensemble_logits(heads, jnp.array([0.25, 0.75]), z), [[0.25 * 1 + 0.75 * 7,
                                                                                   0.25 * 4 + 0.75 * 2]])


def test_fedgen_server_trains_the_generator_towards_the_heads_and_averages_heads():
  d, c = 4, 3
  heads = {'kernel': jnp.stack([jnp.eye(d)[:, :c] * 5.0] * 2), 'bias': jnp.zeros((2, c))}
  uploads = (Uploads(HeadUpload(heads), jnp.array([True, True]), jnp.array([10., 30.])),)
  alg = fedgen(FedGenConfig(noise_dim=3, hidden_dim=8, server_epochs=60, generator_learning_rate=0.005), c,
               label_counts=np.array([5, 25, 10]))
  initial = [SimpleNamespace(params={'head': jax.tree.map(lambda a: a[0], heads)})]
  spec = SimpleNamespace(feature_dim=d, training=LocalTraining(0.05, 16))
  server = alg.init_server(jax.random.PRNGKey(0), spec, initial)
  trained, m = server_step(alg.phases[0], spec)(server, uploads, jax.random.PRNGKey(1))
  np.testing.assert_allclose(trained.head['kernel'], heads['kernel'][0], rtol=1e-6)
  # The ensemble's CE on generated features falls: a fresh and the trained generator on the same draws.
  def ensemble_ce(variables):
    labels = jnp.array([0, 1, 2] * 20)
    noise = jax.random.uniform(jax.random.PRNGKey(7), (60, 3))
    z, _ = FeatureGenerator(c, d, 8).apply(variables, noise, labels, mutable=['batch_stats'])
    logits = ensemble_logits(heads, jnp.array([0.25, 0.75]), z)
    return float(-jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(60), labels]))
  assert ensemble_ce(trained.generator) < 0.5 * ensemble_ce(server.generator)


def test_fedgen_label_distribution_is_all_clients_loader_labels():
  """HtFLlib counts FedGen's labels once, over all clients, through the drop_last train loaders."""
  from fedjax_het.data.datasets import Dataset
  from fedjax_het.data.federated import FederatedData
  from fedjax_het.data.partition import ClientSplit
  y = np.array([0, 1, 1, 2, 2, 2, 0, 0, 1])
  ds = Dataset('hand', np.zeros((9, 2, 2, 1), np.float32), y.astype(np.int32), 3)
  split = ClientSplit([np.array([0, 1, 2, 3, 4]), np.array([5, 6, 7, 8])], [np.zeros(0, int)] * 2,
                      np.zeros((2, 3)), np.zeros((2, 3)))
  data = FederatedData(ds, split, 'pooled')
  # B = 2: client 0 yields rows 0-3 (labels 0 1 1 2), client 1 rows 5-8 (2 0 0 1).
  np.testing.assert_array_equal(data.loader_label_counts(2), [3, 3, 2])
  np.testing.assert_array_equal(data.loader_label_counts(2, drop_last_rows=False), [3, 3, 3])
  with pytest.raises(ConfigError, match='label_counts'):
    fedgen(FedGenConfig(), 3, label_counts=np.array([0, 0, 0]))
  assert FedGenConfig() == FedGenConfig(noise_dim=32, hidden_dim=512, generator_learning_rate=0.1, server_epochs=100)


def test_fml_kl_is_torch_kldivloss_mean_over_batch_and_classes():
  target, logits = jnp.array([[0., math.log(3.)]]), jnp.array([[0., 0.]])
  q, p = np.array([0.25, 0.75]), np.array([0.5, 0.5])
  np.testing.assert_allclose(elementwise_kl(target, logits), (q * np.log(q / p)).sum() / 2, rtol=1e-6)
  y = jnp.array([1])
  ce = lambda z: -float(jax.nn.log_softmax(z)[0, 1])
  expected = 0.3 * ce(logits) + 0.7 * elementwise_kl(target, logits) + 0.6 * ce(target) + 0.4 * elementwise_kl(
      logits, target)
  np.testing.assert_allclose(mutual_loss(logits, target, y, 0.3, 0.6), expected, rtol=1e-6)


def test_fml_server_averages_the_global_models_and_clients_carry_them(tiny_data):
  fed, state, history = golden_federation('fml', data=tiny_data)
  size = sum(a.size for a in jax.tree.leaves(state.server.global_model))
  participants = fed.participants(1)
  assert history[-1]['upload_scalars'] == history[-1]['broadcast_scalars'] == len(participants) * size > 0
  # HtFLlib's serverfml.py: the unweighted mean of the participants' global models.
  copies = [client_state(fed, state, k).extra.params['companion'] for k in participants]
  expected = jax.tree.map(lambda *a: np.mean(np.stack(a), 0), *copies)
  tree_allclose(state.server.global_model, expected, rtol=1e-5, atol=1e-6)
  with pytest.raises(ConfigError, match="^FMLConfig.global_model='vgg99'"):
    fml(FMLConfig(global_model='vgg99'), 4)


def test_fml_companion_with_batchnorm_updates_its_statistics(tiny_data):
  alg = fml(FMLConfig(global_model='resnet4'), tiny_data.num_classes)
  fed = Federation(alg, tiny_data, ModelConfig(['mlp'], feature_dim=16), LocalTraining(0.05, 8, 1),
                   ExecutionConfig(strategy='sequential', conv='xla', eval_batch_size=16))
  stats = lambda st: [np.asarray(a) for a in jax.tree.leaves(st.groups[0].extra.state['companion'])]
  state = fed.init()
  before = stats(state)  # rounds donate their input state
  state, m = fed.round(state)
  assert np.isfinite(m['train_loss'])
  assert not np.allclose(before[0], stats(state)[0])


def test_sgd_on_rows_ignores_rows_of_weight_zero():
  params = jnp.array([0.5, -1.])
  rows = jnp.array([[1., 2.], [3., -1.], [7., 7.]])
  row_loss = lambda p, idx: (rows[idx] @ p) ** 2
  a, _ = sgd_on_rows(params, row_loss, jnp.array([1., 1., 0.]), jax.random.PRNGKey(1), 0.1, 2, 3)
  b, _ = sgd_on_rows(params, lambda p, idx: (rows[:2][idx] @ p) ** 2, jnp.array([1., 1.]), jax.random.PRNGKey(1),
                     0.1, 2, 3)
  np.testing.assert_allclose(a, b, rtol=1e-6)


def test_table11_communication_of_the_cifar_settings():
  """FedRE Table 11 (x 1e3 scalars per round, 10 clients, d = 512): uploads of the prototype methods depend on
  the classes each client holds; 61 (CIFAR-10) and 502 (CIFAR-100) client-class pairs reproduce its figures.
  The figures are each method's accounting of uploads and broadcasts of these shapes."""
  d = 512

  def per_round(scalars, make, present_per_client, parts=None):
    total = 0
    for present in present_per_client:
      total += sum(float(v) for k, v in scalars(make(present)).items() if parts is None or k in parts)
    return round(total / 1e3, 2)

  for c, present, table in [(10, [7] * 1 + [6] * 9, {'lg': 51.30, 'proto_up': 31.23, 'proto_down': 51.20,
                                                    'fedre_up': 5.12, 'fedre_down': 51.30}),
                            (100, [51] * 2 + [50] * 8, {'lg': 513.00, 'proto_up': 257.02, 'proto_down': 512.00,
                                                       'fedre_up': 5.12, 'fedre_down': 513.00})]:
    assert sum(present) == (61 if c == 10 else 502)
    head = {'kernel': jnp.zeros((d, c)), 'bias': jnp.zeros(c)}
    protos = lambda k: PrototypeUpload(jnp.zeros((c, d)), (jnp.arange(c) < k).astype(jnp.float32))
    global_protos = lambda k: Prototypes(jnp.zeros((c, d)), jnp.ones(c, bool))
    lg = lg_fedavg(c)
    assert per_round(lg.phases[0].traffic.upload, lambda k: HeadUpload(head), present) == table['lg']
    assert per_round(lg.phases[0].traffic.broadcast, lambda k: HeadServer(head), present) == table['lg']
    for alg in (fedproto(FedProtoConfig(), c), fedtgp(FedTGPConfig(), c), fedgh(FedGHConfig(), c)):
      assert per_round(alg.phases[0].traffic.upload, protos, present) == table['proto_up']
    for alg in (fedproto(FedProtoConfig(), c), fedtgp(FedTGPConfig(), c)):
      assert per_round(alg.phases[0].traffic.broadcast, global_protos, present) == table['proto_down']
    assert per_round(fedgh(FedGHConfig(), c).phases[0].traffic.broadcast, lambda k: HeadServer(head), present,
                     {'head_kernel'}) == table['proto_down']
    fedre_upload = lambda k: FedREUpload(jnp.zeros((1, d)), jnp.zeros((1, c)), jnp.ones(1))
    assert per_round(fedre(FedREConfig(), c).phases[0].traffic.upload, fedre_upload, present,
                     {'representation'}) == table['fedre_up']
    assert per_round(fedre(FedREConfig(), c).phases[0].traffic.broadcast, lambda k: HeadServer(head), present) == \
        table['fedre_down']
    # FedGen (model-heterogeneous): Table 11 counts the heads (HtFLlib never sends its generator).
    gen = fedgen(FedGenConfig(), c)
    generator = {'params': {'w': jnp.zeros(3)}}
    assert per_round(gen.phases[0].traffic.upload, lambda k: HeadUpload(head), present) == table['lg']
    assert per_round(gen.phases[0].traffic.broadcast, lambda k: FedGenServer(head, generator), present,
                     {'head'}) == table['lg']


def test_bad_baseline_hyperparameters():
  with pytest.raises(ConfigError, match='^FedProtoConfig.lamda=-1.0 must be >= 0'):
    FedProtoConfig(lamda=-1.)
  with pytest.raises(ConfigError, match='^FedTGPConfig.server_batch_size=0 must be >= 1'):
    FedTGPConfig(server_batch_size=0)
  with pytest.raises(ConfigError, match='^FDConfig.lamda=-0.5'):
    FDConfig(lamda=-0.5)

