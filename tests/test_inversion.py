"""Representation inversion (fedjax_het/privacy/): metrics by hand, exact recovery through an invertible
extractor, vmap and padding invariance, upload parsing, and the uploads of a real round."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_het import evaluation as inv
from fedjax_het.errors import ConfigError

SHAPE = (8, 8, 1)


def linear_extractor(seed: int = 0):
  """A full-rank (orthogonal) linear map of 8x8x1 images to d = 64: an invertible extractor."""
  w = jnp.linalg.qr(jax.random.normal(jax.random.PRNGKey(seed), (64, 64)))[0]
  return lambda x: x.reshape(x.shape[0], -1) @ w


def images(n: int, seed: int = 1):
  return 0.9 * jnp.tanh(jax.random.normal(jax.random.PRNGKey(seed), (n,) + SHAPE))


def test_mse_and_psnr_by_hand():
  black, white, grey = -jnp.ones((2, 2, 1)), jnp.ones((2, 2, 1)), jnp.zeros((2, 2, 1))
  # 0 vs 255 everywhere: MSE 255^2, PSNR 0 dB.
  assert float(inv.mse_255(black, white)) == pytest.approx(65025.0)
  assert float(inv.psnr_255(black, white)) == pytest.approx(0.0, abs=1e-5)
  # 127.5 vs 0: MSE 127.5^2 = 16256.25, PSNR 10 log10(4) = 6.0206 dB.
  assert float(inv.mse_255(grey, black)) == pytest.approx(16256.25)
  assert float(inv.psnr_255(grey, black)) == pytest.approx(10 * math.log10(4), abs=1e-4)
  # one pixel of four off by 127.5: MSE 127.5^2 / 4 = 4064.0625, PSNR 10 log10(16) = 12.0412 dB.
  one = grey.at[0, 1, 0].set(1.0)
  assert float(inv.mse_255(grey, one)) == pytest.approx(4064.0625)
  assert float(inv.psnr_255(grey, one)) == pytest.approx(10 * math.log10(16), abs=1e-4)
  # identical images: MSE 0 and PSNR at its cap; batched over leading axes.
  assert float(inv.psnr_255(one, one)) == inv.PSNR_MAX
  np.testing.assert_allclose(inv.mse_255(jnp.stack([black, grey]), white), [65025.0, 16256.25])


def test_ssim_by_hand():
  # Constant images have no variance, so SSIM is its luminance term (2 mu_a mu_b + C1) / (mu_a^2 + mu_b^2 + C1),
  # C1 = (0.01 L)^2, L = 255: grey (127.5) against a quarter grey (63.75); black (0) against 12.75, where only C1
  # keeps it from 0: C1 / (12.75^2 + C1) = 0.0385.
  grey, quarter = jnp.zeros((8, 8, 1)), jnp.full((8, 8, 1), -0.5)
  c1 = (0.01 * 255) ** 2
  want = (2 * 127.5 * 63.75 + c1) / (127.5 ** 2 + 63.75 ** 2 + c1)
  assert float(inv.ssim_255(grey, quarter)) == pytest.approx(want, rel=1e-5)
  dark = float(inv.ssim_255(-jnp.ones((8, 8, 1)), jnp.full((8, 8, 1), -0.9)))
  assert dark == pytest.approx(c1 / (12.75 ** 2 + c1), rel=1e-4)
  assert float(inv.ssim_255(quarter, quarter)) == pytest.approx(1.0, abs=1e-6)
  x = images(2)
  np.testing.assert_allclose(inv.ssim_255(x, x), [1.0, 1.0], atol=1e-5)  # batched over leading axes
  assert float(inv.ssim_255(x[0], -x[0])) < 0  # a negative image anticorrelates


def test_total_variation_by_hand():
  x = jnp.array([[0.0, 1.0], [1.0, 1.0]])[..., None]
  # vertical |1-0|, |1-1| -> mean 0.5; horizontal |1-0|, |1-1| -> mean 0.5
  assert float(inv.total_variation(x)) == pytest.approx(1.0)


def test_candidates_and_best_match():
  y = jnp.array([0, 1, 0, 1, 0])
  valid = jnp.array([True, True, True, True, False])
  np.testing.assert_array_equal(inv.candidate_mask('representation', y, valid, jnp.array([2, 4]), jnp.array([0, 0])),
                                [[0, 0, 1, 0, 0], [0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(inv.candidate_mask('prototype', y, valid, jnp.array([-1]), jnp.array([0])),
                                [[1, 0, 1, 0, 0]])
  np.testing.assert_array_equal(inv.candidate_mask('entangled', y, valid, jnp.array([-1]), jnp.array([1])),
                                [[1, 1, 1, 1, 0]])
  with pytest.raises(ConfigError, match='kind'):
    inv.candidate_mask('logits', y, valid, jnp.array([0]), jnp.array([0]))
  # originals: grey values -1, -0.5, 0, 0.5 (as 2x2 images); the reconstruction 0.4 matches 0.5 when allowed.
  originals = jnp.stack([jnp.full((2, 2, 1), v) for v in (-1.0, -0.5, 0.0, 0.5)])
  recon = jnp.full((2, 2, 2, 1), 0.4)
  allowed = jnp.array([[True, True, True, True], [True, True, False, False]])
  m = inv.leakage(recon, originals, allowed)
  np.testing.assert_array_equal(m['match'], [3, 1])
  np.testing.assert_allclose(m['mse'], [(0.1 * 127.5) ** 2, (0.9 * 127.5) ** 2], rtol=1e-5)
  np.testing.assert_allclose(m['psnr'], 10 * np.log10(255.0 ** 2 / np.asarray(m['mse'])), rtol=1e-5)
  none = inv.leakage(recon[:1], originals, jnp.zeros((1, 4), bool))
  assert int(none['match'][0]) == -1 and float(none['psnr'][0]) == -np.inf


def test_invertible_extractor_is_inverted_exactly():
  """A full-rank linear extractor: the attack recovers the image and the metric reports its maximum."""
  rep = linear_extractor()
  x0 = images(3)
  cfg = inv.InversionConfig(steps=300, learning_rate=0.1, tv_weight=0.0, prior='pixel')
  recon, loss = jax.jit(lambda t: inv.invert(rep, t, SHAPE, cfg, jax.random.PRNGKey(0)))(rep(x0))
  np.testing.assert_allclose(recon, x0, atol=1e-4)
  assert float(loss.max()) < 1e-8
  m = inv.leakage(recon, x0, inv.candidate_mask('representation', jnp.zeros(3, int), jnp.ones(3, bool),
                                                jnp.arange(3), jnp.zeros(3, int)))
  np.testing.assert_array_equal(m['match'], [0, 1, 2])
  np.testing.assert_allclose(m['psnr'], inv.PSNR_MAX)


def test_vmap_and_padding_do_not_change_results():
  rep = linear_extractor()
  targets = rep(images(5, seed=2))
  key = jax.random.PRNGKey(3)
  cfg = inv.InversionConfig(steps=40, learning_rate=0.05, tv_weight=0.1, prior='pixel')
  batched, losses = jax.jit(lambda t: inv.invert(rep, t, SHAPE, cfg, key))(targets)
  one = jax.jit(lambda t, k: inv.invert_one(rep, t, SHAPE, cfg, k))
  for i in (0, 4):
    im, lo = one(targets[i], jax.random.fold_in(key, i))
    np.testing.assert_allclose(batched[i], im, atol=1e-5)
    np.testing.assert_allclose(losses[i], lo, rtol=1e-4, atol=1e-7)
  run = jax.jit(lambda t, i: inv.invert(rep, t, SHAPE, cfg, key, i))
  padded, padded_losses = inv.invert_padded(run, np.asarray(targets), batch=3)  # 5 targets -> 2 batches of 3
  assert padded.shape == (5,) + SHAPE
  np.testing.assert_allclose(padded, batched, atol=1e-5)
  np.testing.assert_allclose(padded_losses, losses, rtol=1e-4, atol=1e-7)


def test_deep_image_prior_lowers_the_loss():
  rep = linear_extractor()
  target = rep(images(1, seed=4))
  key = jax.random.PRNGKey(0)
  start = inv.InversionConfig(steps=1, prior='dip', dip_channels=8, learning_rate=0.01, tv_weight=0.0)
  cfg = inv.InversionConfig(steps=150, prior='dip', dip_channels=8, learning_rate=0.01, tv_weight=0.0)
  _, first = jax.jit(lambda t: inv.invert(rep, t, SHAPE, start, key))(target)
  recon, last = jax.jit(lambda t: inv.invert(rep, t, SHAPE, cfg, key))(target)
  assert recon.shape == (1,) + SHAPE and float(jnp.abs(recon).max()) <= 1.0
  assert float(last[0]) < 0.5 * float(first[0])


def test_config_errors_name_the_flag():
  for kwargs, flag in [(dict(steps=0), '--inversion_steps'), (dict(learning_rate=0.0), '--inversion_lr'),
                       (dict(tv_weight=-1.0), '--tv_weight'), (dict(prior='gan'), '--prior'),
                       (dict(dip_channels=0), '--dip_channels')]:
    with pytest.raises(ConfigError, match=flag):
      inv.InversionConfig(**kwargs)
  with pytest.raises(ConfigError, match='--inversion_batch'):
    inv.invert_padded(lambda t, i: (t, t), np.zeros((2, 4)), batch=0)


def test_upload_targets_of_each_kind():
  reps = np.arange(12.0).reshape(4, 3)
  label = np.eye(2)[[0, 1, 1, 0]]
  all_reps = inv.upload_targets({'rep': reps, 'label': label, 'weight': np.array([1, 1, 1, 0.0])})
  assert all_reps.kind == 'representation'
  np.testing.assert_array_equal(all_reps.vectors, reps[:3])
  np.testing.assert_array_equal(all_reps.rows, [0, 1, 2])
  np.testing.assert_array_equal(all_reps.labels, [0, 1, 1])
  entangled = inv.upload_targets({'rep': reps[:1], 'label': np.array([[0.3, 0.7]]), 'weight': np.ones(1)})
  assert entangled.kind == 'entangled' and entangled.labels.tolist() == [1] and entangled.rows.tolist() == [-1]
  protos = inv.upload_targets({'protos': reps, 'counts': np.array([0, 5, 2, 0])})
  assert protos.kind == 'prototype' and protos.labels.tolist() == [1, 2]
  np.testing.assert_array_equal(protos.vectors, reps[1:3])
  means = inv.upload_targets({'means': reps, 'covs': np.zeros((4, 3, 3)), 'counts': np.array([1, 1, 1, 1])},
                             limit=2)
  assert means.kind == 'prototype' and means.labels.tolist() == [0, 1]
  with pytest.raises(ConfigError, match='--algorithm'):
    inv.upload_targets({'logits': reps})


def test_round_uploads_are_the_trained_extractors_representations():
  """FedAllRep's upload of a participant in round 2, recomputed from the state after round 1, is the eval-mode
  representation of its rows by the client as the real round 2 leaves it; the state is not changed."""
  from fedjax_het.methods import FedREConfig
  from fedjax_het.run.config import ExperimentConfig
  from fedjax_het.engine import ExecutionConfig, Federation, LocalTraining, ModelConfig
  from fedjax_het.run.experiment import make_algorithm
  from golden import TINY, tiny_data
  data = tiny_data()
  cfg = ExperimentConfig(algorithm='fedre', **{**TINY, 'methods': {'fedre': FedREConfig(all_representations=True)}})
  fed = Federation(make_algorithm(cfg, data), data, ModelConfig(['mlp'], feature_dim=16), LocalTraining(0.05, 8, 1),
                   ExecutionConfig(strategy='sequential', conv='xla', eval_batch_size=16), join_ratio=0.5, rounds=2)
  state, _ = fed.round(fed.init())
  before = jax.tree.map(np.asarray, state)
  clients = [int(c) for c in fed.participants(1)[:2]]
  uploads = inv.round_uploads(fed, state, clients)
  jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, state))
  after, _ = fed.round(state)
  assert [u.client for u in uploads] == sorted(clients)
  for u in uploads:
    g = fed.groups[u.group]
    i = int(np.flatnonzero(g.clients == u.client)[0])
    real = jax.tree.map(lambda a: np.asarray(a[i]), after.groups[u.group])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), real.params, u.state.params)
    targets = inv.upload_targets(u.upload)
    assert targets.kind == 'representation' and len(targets.vectors) > 0
    reps = inv.extractor_fn(g.model, u.state.params, u.state.model_state)(jnp.asarray(u.x[targets.rows]))
    np.testing.assert_allclose(targets.vectors, reps, atol=1e-5)
  with pytest.raises(ConfigError, match='--attack_clients'):
    inv.round_uploads(fed, state, [99])
  with pytest.raises(ConfigError, match='--rounds'):
    inv.round_uploads(fed, after, clients)


def test_references_identification_and_the_null_image_by_hand():
  """References: a representation's own sample; a prototype's class-mean image; an entangled representation's mix
  of class means by its soft label. Identification: nearer to its own reference than to any other."""
  x = jnp.stack([jnp.full((2, 2, 1), v) for v in (-1.0, 0.0, 1.0, 0.5, 0.9)])
  y, valid = jnp.array([0, 0, 1, 1, 1]), jnp.array([True, True, True, True, False])
  np.testing.assert_allclose(inv.class_mean_images(x, y, valid, 3)[:, 0, 0, 0], [-0.5, 0.75, 0.0])
  rep = inv.reference_images('representation', jnp.eye(3)[jnp.array([1])], jnp.array([3]), x, y, valid)
  np.testing.assert_allclose(rep[:, 0, 0, 0], [0.5])
  proto = inv.reference_images('prototype', jnp.eye(3)[jnp.array([1, 0])], jnp.array([-1, -1]), x, y, valid)
  np.testing.assert_allclose(proto[:, 0, 0, 0], [0.75, -0.5])
  mixed = inv.reference_images('entangled', jnp.array([[0.2, 0.8, 0.0]]), jnp.array([-1]), x, y, valid)
  np.testing.assert_allclose(mixed[:, 0, 0, 0], [0.2 * -0.5 + 0.8 * 0.75])  # 0.5
  refs = jnp.stack([jnp.full((2, 2, 1), v) for v in (-0.5, 0.0, 0.5)])
  recons = jnp.stack([jnp.full((2, 2, 1), v) for v in (-0.4, 0.4, 0.45)])
  np.testing.assert_array_equal(inv.identified(recons, refs), [True, False, True])
  assert not bool(inv.identified(refs[:1].repeat(2, 0), refs[:1].repeat(2, 0))[0])  # a tie is a miss
  with pytest.raises(ConfigError, match='kind'):
    inv.reference_images('logits', jnp.eye(3)[jnp.array([0])], jnp.array([0]), x, y, valid)


def test_upload_targets_weights_and_populated_classes_first():
  protos = inv.upload_targets({'protos': np.arange(8.0).reshape(4, 2), 'counts': np.array([3, 12, 0, 40])},
                              min_class_samples=10)
  assert protos.labels.tolist() == [3, 1]  # 40 and 12 samples; class 0's 3 are too few
  np.testing.assert_array_equal(protos.weights, np.eye(4)[[3, 1]])
  entangled = inv.upload_targets({'rep': np.ones((1, 2)), 'label': np.array([[0.3, 0.7]]), 'weight': np.ones(1)})
  np.testing.assert_allclose(entangled.weights, [[0.3, 0.7]])
  assert len(inv.upload_targets({'protos': np.ones((2, 2)), 'counts': np.array([1, 2])}, min_class_samples=5)
             .vectors) == 0


def run_result(seed, psnr, null, best, best_null, ident, accuracy):
  return dict(method='fedre', seed=seed, kind='entangled', psnr=np.array(psnr), mse=np.array([100.0, 300.0]),
              null_psnr=np.array(null), best_psnr=np.array(best), best_null_psnr=np.array(best_null),
              identified=np.array(ident), rep_loss=np.zeros(2), accuracy=accuracy,
              ssim=np.array([0.1, 0.3]) + seed / 10, null_ssim=np.array([0.0, 0.0]))


def test_table_and_figure(tmp_path):
  runs = [run_result(0, [10.0, 12.0], [9.0, 9.0], [15.0, 15.0], [14.0, 16.0], [True, False], 0.5),
          run_result(1, [14.0, 16.0], [10.0, 10.0], [14.0, 14.0], [14.0, 14.0], [True, True], 0.7)]
  table = inv.leakage_table(runs)
  # per-seed means: PSNR 11, 15 -> 13 +- 2; gains 2, 5 -> 3.5 +- 1.5; MSE 200, 200; best 15, 14 -> 14.5 +- 0.5;
  # best gains 0, 0; identified 50 %, 100 % -> 75 +- 25; chance 1/2 -> 50; accuracy 60 +- 10; SSIM 0.2, 0.3 ->
  # 0.25 +- 0.05 (null 0).
  assert ('| fedre | entangled | 4 | 13.00 +- 2.00 | 3.50 +- 1.50 | 200.0 +- 0.0 | 0.250 +- 0.050 (0.000 +- 0.000) '
          '| 14.50 +- 0.50 | 0.00 +- 0.00 | 75.0 +- 25.0 | 50.0 +- 0.0 | 0.000 +- 0.000 | 60.00 +- 10.00 | 2 |') in table
  older = inv.leakage_table([{k: v for k, v in r.items() if 'ssim' not in k} for r in runs])
  assert '| 200.0 +- 0.0 | - | 14.50 +- 0.50 |' in older  # results written before SSIM was measured
  path = tmp_path / 'inversion.png'
  inv.plot_reconstructions([('fedre', -np.ones((2,) + SHAPE), np.ones((1,) + SHAPE))], str(path), 'title')
  import matplotlib.image
  picture = matplotlib.image.imread(str(path))
  assert picture.shape[0] > 100 and picture.shape[1] > 100
  assert picture[..., :3].min() < 0.1 and picture[..., :3].max() > 0.9  # the black reference and white reconstruction
