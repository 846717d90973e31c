"""FedType: RAPS scores, thresholds and prediction sets by hand and their coverage, the consensus weight and the
ranking term by hand, and what each of a round's passes trains. (vmap == sequential and its pinned numbers:
tests/test_golden.py; resume == uninterrupted: tests/test_seed_baselines.py; the server's unweighted average of
the shared model: global_model.average_global_models, tested with FML in tests/test_baselines.py.)"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_het.core import Batch, ClientRows
from fedjax_het.errors import ConfigError
from fedjax_het.methods import FedTypeConfig
from fedjax_het.methods.fedtype import conformal_threshold, consensus, ranking_loss, raps_scores, raps_sets
from fedjax_het.run.config import ExperimentConfig
from fedjax_het.run.experiment import build_federation

# softmax [0.5, 0.3, 0.2] with the classes stored in the order (2, 0, 1): the largest probability is class 2's
LOGITS = jnp.log(jnp.array([[0.3, 0.2, 0.5]]))


def test_raps_score_of_the_true_label_by_hand():
  # label 0 has rank 1 (probability 0.3): U pi_(1) + pi_(0) + pen_0 + pen_1 with k_reg = 1, lam = 0.1
  got = raps_scores(LOGITS, jnp.array([0]), jnp.array([0.5]), kreg=1, lam=0.1)
  np.testing.assert_allclose(got, [0.5 * 0.3 + 0.5 + 0.0 + 0.1], rtol=1e-6)
  got = raps_scores(LOGITS, jnp.array([2]), jnp.array([0.25]), kreg=1, lam=0.1)  # rank 0: U pi_(0) + pen_0
  np.testing.assert_allclose(got, [0.25 * 0.5], rtol=1e-6)


def test_threshold_is_numpys_higher_quantile_of_the_real_rows_only():
  scores = jnp.concatenate([jnp.arange(1, 11) / 10.0, jnp.array([9.0, 9.0])])  # two padding rows of 9
  real = jnp.arange(12) < 10
  # position (10 - 1) * 0.9 = 8.1 -> the higher neighbour, index 9 of the sorted real scores: 1.0
  np.testing.assert_allclose(conformal_threshold(scores, real, 0.1), 1.0)
  np.testing.assert_allclose(conformal_threshold(scores, real, 0.5), 0.6)  # position 4.5 -> index 5
  for n in (7, 11, 23):  # numpy itself on the real rows
    s = jax.random.uniform(jax.random.PRNGKey(n), (30,))
    expected = np.quantile(np.asarray(s[:n]), 0.9, method='higher')
    np.testing.assert_allclose(conformal_threshold(s, jnp.arange(30) < n, 0.1), expected)


def test_raps_sets_by_hand_with_the_randomised_last_class():
  # sorted: 0.5 (class 2), 0.3 (class 0), 0.2 (class 1); cumulative + penalty (k_reg 1, lam 0.1): 0.5, 0.9, 1.2.
  # Qhat 0.85: one class under it, plus one -> 2; V = (0.85 - (0.8 - 0.3) - 0.1) / 0.3 = 5/6.
  logits = jnp.repeat(LOGITS, 2, 0)
  sets = raps_sets(logits, jnp.asarray(0.85), jnp.array([0.5, 0.9]), kreg=1, lam=0.1)
  np.testing.assert_array_equal(sets, [[True, False, True], [False, False, True]])  # U < V keeps class 0
  tiny = raps_sets(logits, jnp.asarray(0.0), jnp.array([0.99, 0.99]), kreg=1, lam=0.1)
  np.testing.assert_array_equal(tiny, [[False, False, True]] * 2)  # never empty


def test_raps_sets_cover_one_minus_alpha_of_exchangeable_rows():
  """Split conformal coverage: calibrated on 2,000 rows, the sets of 4,000 fresh rows of the same distribution hold
  their label with frequency >= 1 - alpha (RAPS is randomised: close to it)."""
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  logits = 2.0 * jax.random.normal(keys[0], (6000, 10))
  labels = jax.random.categorical(keys[1], logits)
  u_cal, u_test = jax.random.uniform(keys[2], (2000,)), jax.random.uniform(keys[3], (4000,))
  for alpha in (0.1, 0.3):
    qhat = conformal_threshold(raps_scores(logits[:2000], labels[:2000], u_cal, 5, 0.5), jnp.ones(2000, bool), alpha)
    sets = raps_sets(logits[2000:], qhat, u_test, 5, 0.5)
    coverage = float(jnp.mean(sets[jnp.arange(4000), labels[2000:]]))
    assert 1 - alpha - 0.02 <= coverage <= 1 - alpha + 0.03, (alpha, coverage)


def test_consensus_and_the_ranking_term_by_hand():
  proxy = jnp.array([[True, True, True], [True, False, False]])
  private = jnp.array([[False, True, True], [True, True, False]])
  # row 0: |S_w| 2 <= |S_p| 3: Jaccard 2 / 3; row 1: |S_w| 2 > |S_p| 1: |S_w n S_p| / |S_p| = 1
  np.testing.assert_allclose(consensus(proxy, private), (2 / 3 + 1) / 2, rtol=1e-6)
  np.testing.assert_allclose(consensus(proxy, private, jnp.array([True, False])), 2 / 3, rtol=1e-6)
  # z = [1, 3, 0], S = {0}: pairs (0, 1) relu(3 - 1) = 2 and (0, 2) relu(0 - 1) = 0, over 1 x 2 pairs: 1; a row
  # whose set holds every class adds 0 and counts in the mean
  z = jnp.array([[1.0, 3.0, 0.0], [1.0, 3.0, 0.0]])
  sets = jnp.array([[True, False, False], [True, True, True]])
  np.testing.assert_allclose(ranking_loss(z, sets), 0.5, rtol=1e-6)
  # its gradient raises the set's logit and lowers the class above it: d/dz = [-1/2, 1/2, 0] / 2 rows
  np.testing.assert_allclose(jax.grad(lambda z: ranking_loss(z, sets))(z)[0], [-0.25, 0.25, 0.0], atol=1e-7)


def _federation(**method):
  cfg = ExperimentConfig(algorithm='fedtype', dataset='synthetic:8,8,1', data_fraction=0.1, num_clients=2,
                         models=('mlp',), feature_dim=16, rounds=1, local_epochs=2, batch_size=8, partition='iid',
                         methods={'fedtype': FedTypeConfig(**{'global_model': 'mlp',
                                                              'learning_rate': 0.01, **method})})
  return build_federation(cfg)


def test_calibration_then_alternating_passes_each_train_one_model():
  fed = _federation()
  state = fed.init()
  g, program = fed.groups[0], fed.programs[0][0]
  assert len(program.stages) == 2 * 2  # (private, proxy) per local epoch
  client = jax.tree.map(lambda a: a[0], state.groups[0])
  broadcast = fed.broadcast(state.server, 0, 0)
  n = int(g.train_sizes[0])
  rows = ClientRows(g.train.x[0], g.train.y[0], jnp.asarray(n), jnp.asarray(n))
  jit = jax.jit  # each function one program, as the engine runs it (not an eager op per layer)
  client = jit(program.prepare)(client, rows, broadcast, jax.random.PRNGKey(0))
  qhat = np.asarray(client.extra.thresholds)
  assert np.all(qhat > 0) and np.all(np.isfinite(qhat))  # RAPS scores of 10 classes: at most 1 + 5 lam
  batch = Batch(g.train.x[0, :8], g.train.y[0, :8], jnp.arange(8), None)
  carry = jit(program.init)(client, broadcast, jax.random.PRNGKey(0))
  one, _ = jit(program.stages[0].step)(carry, batch, broadcast, jax.random.PRNGKey(1))
  two, _ = jit(program.stages[1].step)(one, batch, broadcast, jax.random.PRNGKey(2))
  changed = lambda a, b: any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  private, proxy = (lambda c: c[0].params), (lambda c: c[0].extra.params['companion'])
  assert changed(private(carry), private(one)) and not changed(proxy(carry), proxy(one))
  assert changed(proxy(one), proxy(two)) and not changed(private(one), private(two))
  # The ranking term reaches the private model: with the proxy's sets of one class (Qhat 0) inside the private
  # model's sets of all classes (Qhat 10: consensus 1), its step differs from CE alone.
  tight = carry[0]._replace(extra=carry[0].extra._replace(thresholds=jnp.array([0.0, 10.0])))
  step = lambda fed: jit(fed.programs[0][0].stages[0].step)((tight,) + carry[1:], batch, broadcast,
                                                            jax.random.PRNGKey(1))
  from fedjax_het.methods import fedtype
  without = fedtype(FedTypeConfig(global_model='mlp', learning_rate=0.01, backward='none'), 10)
  ce_step = without.phases[0].client(fed.spec.groups[0]).stages[0].step  # the same group, CE alone
  assert changed(private(step(fed)[0]), private(jit(ce_step)((tight,) + carry[1:], batch, broadcast,
                                                             jax.random.PRNGKey(1))[0]))


def test_bad_settings_name_their_fields():
  with pytest.raises(ConfigError, match='FedTypeConfig.alpha=1.0'):
    FedTypeConfig(alpha=1.0)
  with pytest.raises(ConfigError, match="FedTypeConfig.backward='code'"):
    FedTypeConfig(backward='code')
  with pytest.raises(ConfigError, match="--global_model='nope' is not a registered model"):
    _federation(global_model='nope')
  assert math.isclose(FedTypeConfig().learning_rate, 1e-3)  # the code's Adam, not --local_learning_rate


def test_the_proxy_is_fedtype_proxy_where_set_else_the_global_model():
  """--fedtype_proxy names FedType's proxy apart from the shared --global_model (pFedAFM's G), so FedVTC's files run
  its code's 3x3-stem ResNet-18 proxy without changing the other baselines' models; an unknown name is refused."""
  shapes = lambda fed: jax.tree.map(lambda a: a.shape[1:], fed.init().groups[0].extra.params['companion'])
  plain = _federation()
  proxied = _federation(proxy='small_cnn_narrow')
  assert jax.tree.structure(shapes(plain)) != jax.tree.structure(shapes(proxied))
  expected = proxied.groups[0].spec.build_model('small_cnn_narrow')
  want = jax.eval_shape(lambda: expected.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)), train=False))['params']
  assert jax.tree.map(lambda a: a.shape, want) == shapes(proxied)
  with pytest.raises(ConfigError, match='fedtype_proxy'):
    _federation(proxy='no_such_model').init()
