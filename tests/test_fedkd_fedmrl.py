"""FedKD and FedMRL, the methods whose clients train a small global model beside their own: the SVD energy
threshold and compression, the adaptive distillation loss, the mentee learning rate, the fused (Matryoshka)
representation, and FedRE Table 11's FedMRL communication."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import tree_allclose
from golden import client_state, golden_federation
from fedjax_het.engine import ExecutionConfig, Federation, LocalTraining, ModelConfig
from fedjax_het.errors import ConfigError
from fedjax_het.methods import FedKDConfig, FedMRLConfig, fedkd, fedmrl
from fedjax_het.methods.fedkd import (compress_matrix, compress_params, distillation_loss, energy_threshold, kept_rank)
from fedjax_het.methods.fedmrl import matryoshka_loss
from fedjax_het.methods.shared.common import elementwise_kl
from fedjax_het.models.registry import build_model


def test_fedkd_keeps_the_fewest_singular_values_reaching_the_energy():
  s = jnp.array([3., 2., 1.])  # energies 9, 4, 1 of 14: top-1 64%, top-2 92.9%, all 100%
  assert int(kept_rank(s, 0.6)) == 1
  assert int(kept_rank(s, 0.9)) == 2
  assert int(kept_rank(s, 0.95)) == 3  # HtFLlib keeps none here (its search never reaches the last value)
  assert int(kept_rank(jnp.array([5.]), 0.98)) == 1


def test_fedkd_energy_rises_linearly_over_the_rounds():
  cfg = FedKDConfig()
  np.testing.assert_allclose([energy_threshold(cfg, r, 10) for r in (0, 5, 10)], [0.95, 0.965, 0.98], rtol=1e-6)


def test_fedkd_compression_rebuilds_the_truncated_svd_and_counts_its_factors():
  u, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(10, 10)))
  v, _ = np.linalg.qr(np.random.default_rng(1).normal(size=(8, 8)))
  s = np.array([10., 3., 1., 0.5, 0.1, 0.1, 0.05, 0.01])
  w = (u[:, :8] * s) @ v.T
  # energy 0.92: 100 / 110.27 = 90.7% < 92% <= 109 / 110.27, so K = 2 and U, s, V^T cost 2 * (10 + 8 + 1).
  rebuilt, sent = compress_matrix(jnp.asarray(w, jnp.float32), 0.92)
  np.testing.assert_allclose(rebuilt, (u[:, :2] * s[:2]) @ v[:, :2].T, atol=1e-5)
  assert int(sent) == 38
  _, sent = compress_matrix(jnp.asarray(w, jnp.float32), 0.999999)  # K = 7 factors would cost more than W
  assert int(sent) == 80
  params = {'kernel': jnp.asarray(w.reshape(2, 5, 8), jnp.float32), 'bias': jnp.ones(8), 'col': jnp.ones((4, 1))}
  rebuilt, sent = compress_params(params, 0.92)
  np.testing.assert_allclose(rebuilt['kernel'].reshape(10, 8), (u[:, :2] * s[:2]) @ v[:, :2].T, atol=1e-5)
  np.testing.assert_array_equal(rebuilt['bias'], params['bias'])
  assert int(sent) == 38 + 8 + 4  # a conv-like kernel as [prod(...) * in, out]; vectors and columns sent whole


def test_fedkd_loss_divides_distillation_and_hidden_terms_by_the_task_losses():
  rng = np.random.default_rng(2)
  z, zg = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
  r, rg = jnp.asarray(rng.normal(size=(4, 5)), jnp.float32), jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)
  y = jnp.array([0, 2, 1, 1])
  ce = lambda logits: float(optax.softmax_cross_entropy_with_integer_labels(logits, y).mean())
  total = ce(z) + ce(zg)
  hidden = float(np.mean((np.asarray(r) - np.asarray(rg)) ** 2))
  expected = (ce(z) + float(elementwise_kl(zg, z)) / total + hidden / total
              + ce(zg) + float(elementwise_kl(z, zg)) / total + hidden / total)
  np.testing.assert_allclose(distillation_loss(z, zg, r, rg, y), expected, rtol=1e-5)


def test_fedkd_mentee_rate_moves_only_the_mentee_slower(tiny_data):
  def one_round(mentee_rate):
    alg = fedkd(FedKDConfig(global_model='small_cnn_narrow', mentee_learning_rate=mentee_rate), 4, 2)
    fed = Federation(alg, tiny_data, ModelConfig(['mlp'], feature_dim=16), LocalTraining(0.05, 8, 1),
                     ExecutionConfig(strategy='sequential', conv='xla', eval_batch_size=16))
    state = fed.init()
    parts = lambda st: jax.tree.map(np.asarray, {'own': st.groups[0].params, **st.groups[0].extra.params})
    before = parts(state)
    mentee = sum(a.size for a in jax.tree.leaves(state.server.global_model))
    state, m = fed.round(state)
    assert 0 < m['upload_scalars'] <= 6 * mentee  # SVD-compressed: at most the whole mentee per client
    assert m['broadcast_scalars'] == 6 * mentee   # round 1: the uncompressed initial mentee to each participant
    return before, parts(state)
  before, same = one_round(None)
  _, slow = one_round(0.0125)
  step = lambda after, part: np.abs(jax.tree.leaves(after[part])[0] - jax.tree.leaves(before[part])[0]).mean()
  # The first SGD step moves the mentee by a quarter; later steps differ, so compare loosely.
  assert step(slow, 'companion') < 0.6 * step(same, 'companion')
  assert step(slow, 'own') > 0 and step(slow, 'hidden_map') > 0


def test_fedmrl_fuses_the_global_and_local_representations(tiny_data):
  from fedjax_het.methods.fedmrl import fused_forward
  fed, state, _ = golden_federation('fedmrl', data=tiny_data)  # sub_feature_dim 8, d 16, small_cnn_narrow
  client = client_state(fed, state, int(fed.groups[1].clients[0]))  # an 'mlp' client
  x = jax.random.normal(jax.random.PRNGKey(0), (3, 8, 8, 1))
  model, global_model = fed.groups[1].model, build_model('small_cnn_narrow', 4, 8, conv='xla')
  logits, fused, _ = fused_forward(model, global_model, client, x, False)
  own = model.apply({'params': client.params}, x, method=model.represent)
  _, global_rep = global_model.apply({'params': client.extra.params['companion']}, x)
  assert global_rep.shape == (3, 8) and fused.shape == (3, 16)
  proj = client.extra.params['fusion']
  assert proj['kernel'].shape == (8 + 16, 16)
  np.testing.assert_allclose(fused, jnp.concatenate([global_rep, own], -1) @ proj['kernel'] + proj['bias'],
                             rtol=1e-5, atol=1e-6)
  head = client.params['head']
  np.testing.assert_allclose(logits, fused @ head['kernel'] + head['bias'], rtol=1e-5, atol=1e-6)


def test_fedmrl_loss_is_the_sum_of_both_heads_ce():
  z, zg, y = jnp.array([[2., 0.]]), jnp.array([[0., 1.]]), jnp.array([0])
  expected = -np.log(np.exp(2) / (np.exp(2) + 1)) - np.log(1 / (1 + np.e))
  np.testing.assert_allclose(matryoshka_loss(z, zg, y), expected, rtol=1e-6)


def test_fedmrl_server_averages_unweighted_and_clients_keep_proj(tiny_data):
  fed, state, _ = golden_federation('fedmrl', data=tiny_data)
  participants = fed.participants(1)
  copies = [client_state(fed, state, k).extra.params['companion'] for k in participants]
  tree_allclose(state.server.global_model, jax.tree.map(lambda *a: np.mean(np.stack(a), 0), *copies),
                rtol=1e-5, atol=1e-6)
  initial = fed.init()
  for k in set(fed.participants(0)) | set(participants):  # proj is trained on and kept, not reset
    before = client_state(fed, initial, k).extra.params['fusion']['kernel']
    assert not np.allclose(before, client_state(fed, state, k).extra.params['fusion']['kernel'])
  with pytest.raises(ConfigError, match='^FedMRLConfig.sub_feature_dim=32 must be <= ModelConfig.feature_dim=16'):
    fedmrl(FedMRLConfig(sub_feature_dim=32), 4, 16)
  with pytest.raises(ConfigError, match="^FedKDConfig.global_model='vgg99' is not a registered model"):
    fedkd(FedKDConfig(global_model='vgg99'), 4, 10)


@pytest.mark.parametrize('num_classes, table', [(10, 8746.98), (100, 8863.08)])
def test_table11_fedmrl_communication(num_classes, table):
  """FedRE Table 11, FedMRL, 10 clients: HtFLlib's 4-layer CNN with its 512 features pooled to 128 and a
  128 -> C head, uploaded and broadcast whole (x 1e3 scalars per round)."""
  shapes = jax.eval_shape(lambda: build_model('cnn4', num_classes, 128).init(jax.random.PRNGKey(0),
                                                                          jnp.zeros((1, 32, 32, 3))))['params']
  alg = fedmrl(FedMRLConfig(), num_classes, 512)
  assert round(10 * sum(alg.phases[0].traffic.upload({'global_model': shapes}).values()) / 1e3, 2) == table
  assert round(10 * sum(alg.phases[0].traffic.broadcast({'global_model': shapes}).values()) / 1e3, 2) == table
