import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_het.core import ClientRows
from fedjax_het.core import ClientState
from fedjax_het.errors import ConfigError
from fedjax_het.methods.fedre import (FedREConfig, FedREUpload, entangle, entanglement_weights, fedre, fedre_upload,
                                      fedre_weights, random_magnitudes, train_head)
from fedjax_het.methods.shared.base import HeadServer
from fedjax_het.methods.shared.common import class_prototypes, soft_cross_entropy
from fedjax_het.uploads import masked_mean

# Client rows: labels 0, 0, 1, 2 and one padding row; C = 4 (class 3 absent).
Y = jnp.array([0, 0, 1, 2, 3])
VALID = jnp.array([1., 1., 1., 1., 0.])
C = 4
KEY = jax.random.PRNGKey(42)


def test_var_and_vap_weights():
  np.testing.assert_allclose(entanglement_weights(Y, VALID, C, 'var', 'uniform', KEY), [.25, .25, .25, .25, 0])
  # VAP: each present class gets 1/3, spread over its samples (Eq. 11).
  np.testing.assert_allclose(entanglement_weights(Y, VALID, C, 'vap', 'uniform', KEY),
                             [1 / 6, 1 / 6, 1 / 3, 1 / 3, 0], rtol=1e-6)


def test_rap_weights_hand_computed():
  u = np.array(random_magnitudes(KEY, C, 'uniform'))
  u[3] = 0.0  # absent class
  expected_class = u / u.sum()
  expected = [expected_class[0] / 2, expected_class[0] / 2, expected_class[1], expected_class[2], 0.0]
  np.testing.assert_allclose(entanglement_weights(Y, VALID, C, 'rap', 'uniform', KEY), expected, rtol=1e-6)


def test_rar_weights_hand_computed():
  u = np.asarray(random_magnitudes(KEY, 5, 'uniform')) * np.asarray(VALID)
  np.testing.assert_allclose(entanglement_weights(Y, VALID, C, 'rar', 'uniform', KEY), u / u.sum(), rtol=1e-6)


@pytest.mark.parametrize('seed', range(5))
def test_select_mechanisms_pick_real_rows_and_present_classes(seed):
  key = jax.random.PRNGKey(seed)
  w = np.asarray(entanglement_weights(Y, VALID, C, 'rsr', 'uniform', key))
  assert w.sum() == pytest.approx(1) and np.count_nonzero(w) == 1 and w[4] == 0
  w = np.asarray(entanglement_weights(Y, VALID, C, 'rsp', 'uniform', key))
  picked = set(np.asarray(Y)[w > 0])
  assert len(picked) == 1 and 3 not in picked and w.sum() == pytest.approx(1)
  # Eq. 10: 1/n_c for every sample of the chosen class.
  assert np.allclose(w[w > 0], 1 / np.count_nonzero(w))


@pytest.mark.parametrize('dist', ['uniform', 'gaussian', 'laplace'])
@pytest.mark.parametrize('mech', ['rar', 'rap'])
def test_weights_are_a_distribution_over_real_rows(dist, mech):
  w = np.asarray(entanglement_weights(Y, VALID, C, mech, dist, KEY))
  assert np.all(w >= 0) and w[4] == 0 and w.sum() == pytest.approx(1, rel=1e-6)


def test_padding_rows_never_change_weights():
  y_pad = jnp.concatenate([Y, jnp.zeros(7, jnp.int32)])
  v_pad = jnp.concatenate([VALID, jnp.zeros(7)])
  for mech in ['rsr', 'var', 'rar', 'rsp', 'vap', 'rap']:
    a = entanglement_weights(Y, VALID, C, mech, 'uniform', KEY)
    b = entanglement_weights(y_pad, v_pad, C, mech, 'uniform', KEY)
    np.testing.assert_allclose(b[:5], a, rtol=1e-6, err_msg=mech)
    assert np.all(np.asarray(b[5:]) == 0)


def test_entangle_hand_computed_and_rap_equals_weighted_prototypes():
  reps = jnp.array([[1., 0.], [3., 2.], [0., 4.], [2., 2.], [9., 9.]])
  w = jnp.array([.1, .2, .3, .4, 0.])
  r, y = entangle(reps, Y, w, C)
  np.testing.assert_allclose(r, [.1 + .6 + .8, .4 + 1.2 + .8], rtol=1e-6)
  np.testing.assert_allclose(y, [.3, .3, .4, 0.], rtol=1e-6)
  # RAP (Eq. 12) == sum_c W_c p_c with p_c the class prototypes.
  protos, counts = class_prototypes(reps, Y, VALID, C)
  np.testing.assert_allclose(protos[0], [2., 1.])
  np.testing.assert_allclose(counts, [2, 1, 1, 0])
  w = entanglement_weights(Y, VALID, C, 'rap', 'uniform', KEY)
  class_w = np.array([w[0] * 2, w[2], w[3], 0.0])
  r, _ = entangle(reps, Y, w, C)
  np.testing.assert_allclose(r, class_w @ np.asarray(protos), rtol=1e-5)


def test_masked_mean_ignores_masked_rows():
  v = jnp.array([[1., 2.], [3., 4.], [100., 100.]])
  np.testing.assert_allclose(masked_mean(v, jnp.array([1, 1, 0])), [2., 3.])


def test_server_step_matches_hand_computed_soft_ce_gradient():
  rng = np.random.default_rng(0)
  d, c = 3, 4
  head = {'kernel': jnp.asarray(rng.normal(size=(d, c)), jnp.float32), 'bias': jnp.zeros(c)}
  reps = jnp.asarray(rng.normal(size=(2, d)), jnp.float32)
  soft = jnp.array([[.5, .5, 0, 0], [0, .2, .3, .5]])
  cfg = FedREConfig(server_learning_rate=0.1, server_batch_size=10, server_loss_reduction='sum')
  new, _ = train_head(head, reps, soft, jnp.ones(2), jax.random.PRNGKey(0), cfg)
  # d/dz sum_i CE_soft(z_i, y_i) = softmax(z_i) - y_i, so dW = sum_i r_i^T (p_i - y_i).
  z = np.asarray(reps) @ np.asarray(head['kernel'])
  p = np.exp(z - z.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  grad_w = np.asarray(reps).T @ (p - np.asarray(soft))
  np.testing.assert_allclose(new['kernel'], np.asarray(head['kernel']) - 0.1 * grad_w, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(new['bias'], -0.1 * (p - np.asarray(soft)).sum(0), rtol=1e-5, atol=1e-6)
  # 'mean' divides the batch loss by its size.
  new_mean, _ = train_head(head, reps, soft, jnp.ones(2), jax.random.PRNGKey(0),
                           FedREConfig(server_learning_rate=0.1, server_loss_reduction='mean'))
  np.testing.assert_allclose(new_mean['kernel'], np.asarray(head['kernel']) - 0.05 * grad_w, rtol=1e-5, atol=1e-6)


def test_server_step_ignores_zero_weight_rows():
  rng = np.random.default_rng(1)
  head = {'kernel': jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), 'bias': jnp.zeros(4)}
  reps = jnp.asarray(rng.normal(size=(23, 3)), jnp.float32)
  soft = jax.nn.softmax(jnp.asarray(rng.normal(size=(23, 4)), jnp.float32))
  weight = jnp.asarray((np.arange(23) < 13).astype(np.float32))
  cfg = FedREConfig(server_batch_size=4, server_epochs=2)
  a, _ = train_head(head, reps[:13], soft[:13], weight[:13], jax.random.PRNGKey(3), cfg)
  b, _ = train_head(head, reps.at[13:].set(99.), soft, weight, jax.random.PRNGKey(3), cfg)
  np.testing.assert_allclose(a['kernel'], b['kernel'], rtol=1e-6)


def test_soft_cross_entropy_value():
  np.testing.assert_allclose(soft_cross_entropy(jnp.zeros((1, 4)), jnp.array([[.5, .5, 0, 0]])), [np.log(4)],
                             rtol=1e-6)


def test_fixed_sampling_reuses_weights_and_resampling_changes_them():
  reps = jnp.asarray(np.random.default_rng(0).normal(size=(5, 8)), jnp.float32)
  client = ClientState({'head': {}}, {}, {}, jax.random.PRNGKey(9))
  rows = ClientRows(None, Y, 4, 5, reps)
  for resample, same in [(False, True), (True, False)]:
    cfg = FedREConfig(resample=resample)
    upload, weights = fedre_upload(cfg, C), fedre_weights(cfg, C)
    # the engine hands the upload sum_i w_i r_i, with the weights of the same key
    entangled = lambda key: upload(client, rows._replace(reps=weights(client, rows, {}, key).T @ reps), {}, key)
    a, b = entangled(jax.random.PRNGKey(1)), entangled(jax.random.PRNGKey(2))
    assert np.allclose(a.rep, b.rep) == same and np.allclose(a.label, b.label) == same
    w = weights(client, rows, {}, jax.random.PRNGKey(1))[:, 0]
    np.testing.assert_allclose(a.rep[0], w @ reps, rtol=1e-6)  # Eq. 6
    np.testing.assert_allclose(a.label[0], w @ jax.nn.one_hot(Y, C), rtol=1e-6)


def test_fedallrep_uploads_every_real_row():
  reps = jnp.ones((5, 8))
  up = fedre_upload(FedREConfig(all_representations=True), C)(ClientState({}, {}, {}, KEY),
                                                              ClientRows(None, Y, 4, 5, reps), {}, KEY)
  assert up.rep.shape == (5, 8) and up.label.shape == (5, C)
  np.testing.assert_allclose(up.weight, VALID)


@pytest.mark.parametrize('num_classes,d,upload_k,broadcast_k', [
    (10, 512, 5.12, 51.30),      # CIFAR-10, FedRE Table 11
    (100, 512, 5.12, 513.00),    # CIFAR-100
    (200, 2048, 20.48, 4098.00), # TinyImageNet (d = 2048)
])
def test_communication_matches_table_11(num_classes, d, upload_k, broadcast_k):
  alg = fedre(FedREConfig(), num_classes)
  upload = FedREUpload(jnp.zeros((1, d)), jnp.zeros((1, num_classes)), jnp.ones(1))
  traffic = alg.phases[0].traffic
  up = traffic.upload(upload)
  down = traffic.broadcast(HeadServer({'kernel': jnp.zeros((d, num_classes)), 'bias': jnp.zeros(num_classes)}))
  # Table 11 counts 10 clients, scalars x 1e3, and leaves the soft label out of the upload.
  assert 10 * int(up['representation']) / 1e3 == pytest.approx(upload_k)
  assert 10 * sum(down.values()) / 1e3 == pytest.approx(broadcast_k)
  assert int(up['label']) == num_classes
  # FedAllRep: d + C per row sent (the rows with weight), none for padding rows.
  rows = FedREUpload(jnp.zeros((7, d)), jnp.zeros((7, num_classes)), jnp.array([1.] * 5 + [0.] * 2))
  all_reps = fedre(FedREConfig(all_representations=True), num_classes).phases[0].traffic
  assert int(all_reps.upload(rows)['representation']) == 5 * d


def test_bad_fedre_settings_raise_clear_errors():
  with pytest.raises(ConfigError, match="^FedREConfig.mechanism='xyz' is unknown"):
    FedREConfig(mechanism='xyz')
  with pytest.raises(ConfigError, match="^FedREConfig.weight_distribution='cauchy'"):
    FedREConfig(weight_distribution='cauchy')
