"""FPL and CCVR: FINCH clustering of prototypes, FPL's contrastive + unbiased-prototype loss, CCVR's global
Gaussians (equal to the pooled statistics), sampling and head calibration, and torch-style SGD with momentum."""

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_het.methods import CCVRConfig
from fedjax_het.methods.ccvr import calibrate_head, class_statistics, global_gaussians, sample_virtual
from fedjax_het.methods.fpl import compact_clusters, fpl_regularizer, unbiased_prototypes
from fedjax_het.methods.shared.common import cosine_similarity, head_apply, sgd_on_rows
from fedjax_het.methods.shared.finch import finch, first_neighbor_partition


def test_first_neighbor_links_mutual_and_shared_neighbors():
  # a <-> b mutual first neighbours; c and d share the first neighbour e; f is padding.
  pts = jnp.array([[1., 0.], [0.99, 0.1], [0., 1.], [0.1, 1.], [0.05, 1.], [1., 1.]])
  valid = jnp.array([True, True, True, True, True, False])
  assert first_neighbor_partition(pts, valid).tolist() == [0, 0, 2, 2, 2, 5]


def test_finch_stops_before_a_single_cluster():
  pts = jnp.array([[1., 0.], [0.99, 0.1], [0., 1.], [0.1, 0.99], [0., 0.], [0., 0.]])
  valid = jnp.array([True, True, True, True, False, False])
  # Level 0: {0, 1}, {2, 3}; level 1 would merge everything, so level 0 is the answer (RethinkFL's c[:, -1]).
  assert finch(pts, valid).tolist() == [0, 0, 2, 2, 4, 5]
  # Three tight pairs: level 1 links them all (the middle pair is the others' first neighbour), so level 0 stays.
  points = lambda ang: jnp.stack([jnp.cos(jnp.array(ang)), jnp.sin(jnp.array(ang))], 1)
  assert finch(points([0., 0.02, 1.0, 1.02, 2.6, 2.62]), jnp.ones(6, bool)).tolist() == [0, 0, 2, 2, 4, 4]
  # Four pairs in two groups: level 0 gives 4 clusters, level 1 merges them into 2, level 2 would leave 1.
  labels = finch(points([0., 0.02, 0.5, 0.52, 2.0, 2.02, 2.5, 2.52]), jnp.ones(8, bool)).tolist()
  assert labels == [0, 0, 0, 0, 4, 4, 4, 4]
  assert finch(pts[:1], jnp.ones(1, bool)).tolist() == [0]


def test_fpl_loss_is_infonce_to_cluster_prototypes_plus_mse_to_their_mean():
  tau = 0.5
  clusters = jnp.array([[[1., 0.], [0., 1.]], [[-1., 0.], [0., 0.]], [[0., 0.], [0., 0.]]])  # [C=3, K=2, d]
  valid = jnp.array([[True, True], [True, False], [False, False]])  # class 2 has no prototype
  reps = jnp.array([[2., 1.], [3., 3.]])
  labels = jnp.array([0, 2])
  r = np.array([2., 1.])
  cos = lambda p: r @ p / np.linalg.norm(r) / np.linalg.norm(p)
  pos = np.exp(cos(np.array([1., 0.])) / tau) + np.exp(cos(np.array([0., 1.])) / tau)
  info = -np.log(pos / (pos + np.exp(cos(np.array([-1., 0.])) / tau)))
  mse = np.mean((r - np.array([0.5, 0.5])) ** 2)
  np.testing.assert_allclose(unbiased_prototypes(clusters, valid)[0], [0.5, 0.5])
  # Row 1's class has no prototype: it adds nothing but counts in the batch of 2 (RethinkFL divides by it).
  np.testing.assert_allclose(fpl_regularizer(reps, labels, clusters, valid, tau), (info + mse) / 2, rtol=1e-5)


def test_fpl_compaction_keeps_the_valid_clusters_first():
  c, v = compact_clusters(jnp.arange(8.).reshape(4, 2), jnp.array([False, True, False, True]), 6)
  assert v.tolist() == [True, True, False, False, False, False]
  np.testing.assert_array_equal(c[:2], [[2., 3.], [6., 7.]])


def test_ccvr_global_gaussian_equals_the_pooled_statistics():
  rng = np.random.default_rng(0)
  reps = [rng.normal(size=(n, 3)) for n in (5, 7, 1)]
  labels = [rng.integers(0, 2, n) for n in (5, 7, 1)]
  stats = [class_statistics(jnp.asarray(r, jnp.float32), jnp.asarray(y), jnp.ones(len(y), bool), 2)
           for r, y in zip(reps, labels)]
  means, covs, counts = (jnp.stack(s) for s in zip(*stats))
  for k in range(3):  # each client's statistics are numpy's mean and unbiased covariance
    for c in range(2):
      rows = reps[k][labels[k] == c]
      if len(rows) > 1:
        np.testing.assert_allclose(covs[k, c], np.cov(rows.T), rtol=1e-4, atol=1e-5)
  mu, sigma, total = global_gaussians(means, covs, counts)
  pooled, y = np.concatenate(reps), np.concatenate(labels)
  for c in range(2):
    np.testing.assert_allclose(mu[c], pooled[y == c].mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sigma[c], np.cov(pooled[y == c].T), rtol=1e-4, atol=1e-5)
    assert total[c] == (y == c).sum()


def test_ccvr_samples_match_the_gaussian_and_calibration_fits_them():
  mu = jnp.array([[4., 0.], [-4., 0.]])
  sigma = jnp.array([[[1., 0.5], [0.5, 2.]], [[0.5, 0.], [0., 0.5]]])
  virtual = sample_virtual(jax.random.PRNGKey(0), mu, sigma, 4000)
  np.testing.assert_allclose(virtual[0].mean(0), mu[0], atol=0.1)
  np.testing.assert_allclose(np.cov(np.asarray(virtual[0]).T), sigma[0], atol=0.15)
  head = {'kernel': jnp.array([[-1., 1.], [0., 0.]]), 'bias': jnp.zeros(2)}  # predicts the wrong class
  cfg = CCVRConfig(virtual_per_class=4000, calibration_learning_rate=0.01, calibration_epochs=1)
  calibrated = calibrate_head(head, virtual, jnp.array([True, True]), jax.random.PRNGKey(1), cfg, 32)
  pred = jnp.argmax(head_apply(calibrated, virtual.reshape(-1, 2)), -1)
  assert float(jnp.mean(pred == jnp.repeat(jnp.arange(2), 4000))) > 0.99


def test_sgd_on_rows_with_momentum_and_decay_is_torchs_sgd():
  rows = jnp.array([[1., 2.], [3., -1.], [0.5, 0.5]])
  params = jnp.array([0.3, -0.2])
  lr, mom, wd = 0.1, 0.9, 0.01
  out, _ = sgd_on_rows(params, lambda p, idx: (rows[idx] @ p) ** 2, jnp.ones(3), jax.random.PRNGKey(0), lr,
                       3, 2, momentum=mom, weight_decay=wd)
  p, buf = np.array([0.3, -0.2]), np.zeros(2)
  r = np.asarray(rows)
  for _ in range(2):  # one full batch per epoch, so the order does not matter
    g = np.mean([2 * (x @ p) * x for x in r], axis=0) + wd * p
    buf = mom * buf + g
    p = p - lr * buf
  np.testing.assert_allclose(out, p, rtol=1e-5)
  # A batch holding only weight-0 rows is no step, even with momentum: 2 real rows and batches of 2 give one step.
  one, _ = sgd_on_rows(params, lambda p, idx: (rows[idx] @ p) ** 2, jnp.array([1., 1., 0.]), jax.random.PRNGKey(0),
                       lr, 2, 1, momentum=mom)
  g = np.mean([2 * (x @ np.asarray(params)) * x for x in r[:2]], axis=0)
  np.testing.assert_allclose(one, np.asarray(params) - lr * g, rtol=1e-5)


def test_cosine_similarity_guards_zero_vectors():
  sim = cosine_similarity(jnp.array([[3., 4.], [0., 0.]]), jnp.array([[3., 4.], [4., -3.]]))
  np.testing.assert_allclose(sim, [[1., 0.], [0., 0.]], atol=1e-6)
