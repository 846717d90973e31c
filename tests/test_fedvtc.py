"""FedVTC: its terms against hand-computed values, the VTC decoder's shapes and
parameter counts, gradient isolation of its two steps, the server's means, generation, and the three-phase run
(vmap == sequential, resume across the fine-tuning boundary, outputs)."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_het.core import Uploads
from fedjax_het.engine.groups import count_params
from fedjax_het.errors import ConfigError
from fedjax_het.methods import FedVTCConfig
from fedjax_het.methods.fedvtc import (FedVTCServer, VTCUpload, finetune_latents, kl_to_prototype, reconstruction_error,
                                       sum_of_class_means, vtc_objective, vtc_steps)
from fedjax_het.models.vtc import VTCDecoder, init_vtc
from fedjax_het.run.checkpoints import Checkpoints
from fedjax_het.run.config import ExperimentConfig
from fedjax_het.run.experiment import build_federation, train_and_evaluate
from fedjax_het.uploads import RoundUploads

from conftest import tree_allclose
from runs import record_rounds, run_rounds

# One architecture group keeps compilation (which dominates these tests) small; the server's cross-group means are
# the shared `RoundUploads.class_mean`, tested with two groups in tests/test_uploads.py.
CFG = ExperimentConfig(algorithm='fedvtc', dataset='synthetic:8,8,1', num_clients=4, alpha=0.5,
                       models=('small_cnn_narrow',), feature_dim=80, rm='fc', rounds=1, batch_size=32,
                       local_learning_rate=0.01, eval_protocol='global', conv='xla', checkpoint_every=1, join_ratio=0.5,
                       methods={'fedvtc': FedVTCConfig(samples_per_class=8, finetune_epochs=2)})


# ------------------------------------------------------------------ the terms (Eq. 3-5)
def test_kl_term_equals_the_hand_computed_values():
  z, c = jnp.array([[1.0, 2.0]]), jnp.zeros((1, 2))
  assert float(kl_to_prototype(z, c, jnp.array([1.0, 1.0]))[0]) == pytest.approx(2.5)
  assert float(kl_to_prototype(z, c, jnp.array([2.0, 0.5]))[0]) == pytest.approx(3.625)  # trace 4.25, log-det 0


def test_l_e_counts_the_sigma_term_once_per_class_present():
  z = jnp.zeros((4, 2))  # z = c: only the sigma part remains, 0.5 (4.25 - 2 - 0) = 1.125 per row
  kl = kl_to_prototype(z, z, jnp.array([2.0, 0.5]))
  labels = jnp.array([0, 0, 0, 1])
  assert float(sum_of_class_means(kl, labels, 3)) == pytest.approx(2 * 1.125)
  assert float(sum_of_class_means(jnp.array([1.0, 2.0, 3.0, 10.0]), labels, 3)) == pytest.approx(2.0 + 10.0)


def test_reconstruction_error_is_a_pixel_sum_against_images_mapped_to_unit_range():
  decoded = jnp.zeros((2, 8, 8, 1))
  x = jnp.stack([-jnp.ones((8, 8, 1)), jnp.ones((8, 8, 1))])  # x01 = 0 and 1
  np.testing.assert_allclose(reconstruction_error(decoded, x), [0.0, 64.0])


# ------------------------------------------------------------------ the VTC decoder
@pytest.mark.parametrize('shape,p,params', [((28, 28, 1), 980, 21_043), ((32, 32, 3), 4096, 91_625),
                                            ((64, 64, 3), 32_768, 179_785), ((8, 8, 1), 80, 21_043)])
def test_vtc_output_shapes_and_parameter_counts_are_the_papers(shape, p, params):
  decoder = VTCDecoder(shape, p)
  variables = jax.eval_shape(lambda k: init_vtc(decoder, k), jax.random.PRNGKey(0))
  assert count_params(variables['params']) == params
  out = jax.eval_shape(lambda v: decoder.apply(v, jnp.zeros((2, p)), False), variables)
  assert out.shape == (2,) + shape


def torch_conv_transpose(x: np.ndarray, w: np.ndarray, stride: int, padding: int) -> np.ndarray:
  """PyTorch's ConvTranspose2d by its definition, one scatter per input pixel: x [H, W, in], weight w [in, out, k,
  k]; out[y s - p + i, x s - p + j, o] += x[y, x, c] w[c, o, i, j], rows and columns outside the output dropped."""
  h, wd, _ = x.shape
  k = w.shape[-1]
  size = lambda n: (n - 1) * stride - 2 * padding + k
  out = np.zeros((size(h), size(wd), w.shape[1]))
  for y in range(h):
    for xx in range(wd):
      for i in range(k):
        for j in range(k):
          oy, ox = y * stride - padding + i, xx * stride - padding + j
          if 0 <= oy < out.shape[0] and 0 <= ox < out.shape[1]:
            out[oy, ox] += x[y, xx] @ w[:, :, i, j]
  return out


def test_the_transposed_convolution_is_pytorchs():
  """ConvTranspose2d(k4, s2, p1), VTC's upsampling layer: by hand on a 2x2 input with an all-ones kernel, and
  against PyTorch's definition with a random, asymmetric one (the library's kernel is PyTorch's flipped, its axes
  swapped), in both convolution formulations."""
  import flax.linen as nn
  from fedjax_het.models.conv import conv_transpose

  class Up(nn.Module):
    impl: str
    out: int

    @nn.compact
    def __call__(self, x):
      return conv_transpose(self.impl, x, self.out, 4, 2, 1, 'convt')

  def run(impl, x, w):
    kernel = np.transpose(w[:, :, ::-1, ::-1], (2, 3, 0, 1))  # [in, out, k, k] -> flipped [k, k, in, out]
    variables = {'params': {'convt': {'kernel': jnp.asarray(kernel), 'bias': jnp.zeros(w.shape[1])}}}
    return np.asarray(Up(impl, w.shape[1]).apply(variables, jnp.asarray(x)[None]))[0]

  ones = np.ones((1, 1, 4, 4), np.float32)
  x = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)[:, :, None]
  by_hand = np.array([[1, 3, 3, 2], [4, 10, 10, 6], [4, 10, 10, 6], [3, 7, 7, 4]], np.float32)[:, :, None]
  rng = np.random.default_rng(0)
  x2, w2 = rng.normal(size=(3, 5, 2)).astype(np.float32), rng.normal(size=(2, 3, 4, 4)).astype(np.float32)
  np.testing.assert_allclose(torch_conv_transpose(x, ones, 2, 1), by_hand)
  for impl in ('xla', 'im2col'):
    np.testing.assert_allclose(run(impl, x, ones), by_hand, atol=1e-5)
    out = run(impl, x2, w2)
    assert out.shape == (6, 10, 3)  # (H - 1) * 2 - 2 + 4
    np.testing.assert_allclose(out, torch_conv_transpose(x2, w2, 2, 1), atol=1e-4)


def test_a_latent_width_that_does_not_reshape_is_named():
  with pytest.raises(ConfigError, match='ModelConfig.feature_dim must be p = 980'):
    jax.eval_shape(lambda k: init_vtc(VTCDecoder((28, 28, 1), 512), k), jax.random.PRNGKey(0))


# ------------------------------------------------------------------ the two steps
@pytest.fixture(scope='module')
def fed():
  return build_federation(CFG)


def _client(fed, k=0):
  state = fed.init()
  return jax.jit(lambda s: jax.tree.map(lambda a: a[k], s))(state.groups[0]), fed.groups[0]


def test_the_f_step_leaves_psi_and_sigma_and_the_psi_step_leaves_f_unchanged(fed):
  client, g = _client(fed)
  decoder = VTCDecoder(g.spec.input_shape, 80)
  f_step, psi_step = map(jax.jit, vtc_steps(g.model, decoder, 10, 0.1, optax.sgd(0.05)))
  x, y = g.train.x[0, :16], g.train.y[0, :16]
  protos, eps = jnp.ones((10, 80)), jax.random.normal(jax.random.PRNGKey(1), (16, 80))
  after_f, _ = f_step(client, x, y, protos, eps)
  tree_allclose(after_f.extra, client.extra, rtol=0, atol=0)
  assert not np.allclose(after_f.params['head']['kernel'], client.params['head']['kernel'])
  after_psi, _ = psi_step(after_f, x, y, protos, eps)
  tree_allclose((after_psi.params, after_psi.model_state), (after_f.params, after_f.model_state), rtol=0, atol=0)
  assert not np.allclose(after_psi.extra.sigma, after_f.extra.sigma)
  assert not np.allclose(after_psi.extra.psi['params']['convt0']['kernel'],
                         after_f.extra.psi['params']['convt0']['kernel'])


def test_the_f_step_trains_g_through_the_decoder_and_through_g_of_the_decoded_images(fed):
  """L_tc's gradient reaches g along both of its paths: through x' = psi(g(x) + sigma eps) (L_rc; visible as the
  f-step's extractor update changing when only psi changes, which CE and KL do not read) and through g(x')
  (L_dm; visible as the update changing with lambda). An f-step on CE alone would show neither."""
  client, g = _client(fed)
  decoder = VTCDecoder(g.spec.input_shape, 80)
  x, y = g.train.x[0, :16], g.train.y[0, :16]
  protos, eps = jnp.ones((10, 80)), jax.random.normal(jax.random.PRNGKey(1), (16, 80))
  step = lambda lam, c: jax.jit(vtc_steps(g.model, decoder, 10, lam, optax.sgd(0.05))[0])(c, x, y, protos, eps)[0]
  extractor = lambda c: np.concatenate([np.ravel(a) for a in jax.tree.leaves(c.params['extractor'])])
  base = extractor(step(0.1, client))
  psi = client.extra.psi
  scaled = {**psi, 'params': jax.tree.map(lambda a: 1.5 * a, psi['params'])}
  other_psi = extractor(step(0.1, client._replace(extra=client.extra._replace(psi=scaled))))
  no_dm = extractor(step(0.0, client))
  start = extractor(client)
  assert np.abs(other_psi - base).max() > 1e-3 * np.abs(base - start).max()
  assert np.abs(no_dm - base).max() > 1e-3 * np.abs(base - start).max()


def test_mean_reduction_divides_l_rc_by_the_pixels_and_kl_and_l_dm_by_p(fed):
  """Both reductions against the terms computed here in numpy from the model's z, the decoder's x' and g(x')."""
  from fedjax_het.models.forward import forward
  client, g = _client(fed)
  decoder = VTCDecoder(g.spec.input_shape, 80)
  x, y = g.train.x[0, :16], g.train.y[0, :16]
  sigma, protos = client.extra.sigma * 0.5, jnp.ones((10, 80))
  eps = jax.random.normal(jax.random.PRNGKey(1), (16, 80))
  args = (client.params, client.model_state, client.extra.psi, sigma, x, y, protos, eps)
  @jax.jit  # one program, not an eager op per layer
  def terms(params, model_state, psi):
    _, z, _ = forward(g.model, params, model_state, x, True)
    decoded = decoder.apply(psi, z + sigma * eps, True, mutable=['batch_stats'])[0]
    return z, decoded, forward(g.model, params, model_state, 2.0 * decoded - 1.0, True)[1]
  z, decoded, z_dec = terms(client.params, client.model_state, client.extra.psi)
  z, decoded, z_dec, yv, sig = (np.asarray(a, np.float64) for a in (z, decoded, z_dec, y, sigma))
  per_row = {'rc': ((decoded - (np.asarray(x) + 1) / 2) ** 2).reshape(16, -1).sum(1),
             'kl': 0.5 * (((z - 1.0) ** 2).sum(1) + (sig ** 2).sum() - 80 - np.log(sig ** 2).sum()),
             'dm': ((z_dec - 1.0) ** 2).sum(1)}
  term = {k: sum(v[yv == c].mean() for c in np.unique(yv)) for k, v in per_row.items()}
  ce_sum, tc_sum, _ = jax.jit(vtc_objective(g.model, decoder, 10, 0.1))(*args)
  ce_mean, tc_mean, _ = jax.jit(vtc_objective(g.model, decoder, 10, 0.1, 'mean'))(*args)
  assert float(ce_sum) == float(ce_mean)
  np.testing.assert_allclose(tc_sum, term['rc'] + term['kl'] + 0.1 * term['dm'], rtol=1e-4)
  np.testing.assert_allclose(tc_mean, term['rc'] / 64 + term['kl'] / 80 + 0.1 * term['dm'] / 80, rtol=1e-4)
  with pytest.raises(ConfigError, match="^FedVTCConfig.loss_reduction='avg'"):
    FedVTCConfig(loss_reduction='avg')


# ------------------------------------------------------------------ the server
def test_server_averages_prototypes_over_holders_keeps_unheld_classes_and_averages_sigma(fed):
  server = fed.algorithm.init_server(None, fed.spec, [jax.tree.map(lambda a: a[0], s) for s in fed.init().groups])
  server = server._replace(protos=server.protos.at[2].set(7.0), present=server.present.at[2].set(True))
  protos = jnp.zeros((3, 10, 80)).at[0, 0].set(1.0).at[1, 0].set(3.0).at[1, 1].set(5.0).at[2].set(100.0)
  counts = jnp.zeros((3, 10)).at[0, 0].set(4).at[1, :2].set(2).at[2].set(9)
  sigma = jnp.stack([jnp.full(80, 1.0), jnp.full(80, 3.0), jnp.full(80, 50.0)])
  uploads = (Uploads(VTCUpload(protos, counts, sigma), jnp.array([True, True, False]), jnp.ones(3)),)
  new, _ = fed.algorithm.phases[0].server_update(server, RoundUploads(uploads), None)
  np.testing.assert_allclose(new.protos[:3, 0], [2.0, 5.0, 7.0])  # holders only; class 2 kept
  np.testing.assert_array_equal(new.present[:3], [True, True, True])
  assert not new.present[3]
  np.testing.assert_allclose(new.sigma, 2.0)  # unweighted over the participants


def test_the_final_psi_is_the_mean_of_every_clients_psi(fed):
  server = FedVTCServer(None, None, None, {'w': jnp.zeros(2)})
  psi = {'w': jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 9.0]])}
  uploads = RoundUploads((Uploads(VTCUpload(psi=psi), jnp.ones(3, bool), jnp.ones(3)),))
  new, _ = fed.algorithm.phases[1].server_update(server, uploads, None)
  np.testing.assert_allclose(new.psi['w'], [3.0, 5.0])


def test_generated_latents_have_mean_c_and_sd_sigma_and_the_right_labels():
  """The fine-tuning step's latents (`finetune_latents`, what its step decodes): S rows per class, label r // S,
  per-class mean c^y and SD sigma (a large-S check), each row's draw its own."""
  S, C, p = 4000, 3, 4
  rows = jnp.arange(S * C)
  protos, sigma = jnp.array([[0.0] * p, [1.0] * p, [-2.0, 3.0, 0.5, 4.0]]), jnp.array([0.5, 1.0, 2.0, 0.1])
  latents, labels = finetune_latents(jax.random.PRNGKey(0), rows, S, protos, sigma)
  assert np.bincount(np.asarray(labels)).tolist() == [S] * C
  np.testing.assert_array_equal(labels[S - 1:S + 1], [0, 1])
  for c in range(C):
    block = np.asarray(latents[labels == c])
    np.testing.assert_allclose(block.mean(0), protos[c], atol=4 * float(sigma.max()) / np.sqrt(S))
    np.testing.assert_allclose(block.std(0), sigma, rtol=0.05)
  few, _ = finetune_latents(jax.random.PRNGKey(0), rows[S:S + 5], S, protos, sigma)
  np.testing.assert_array_equal(few, latents[S:S + 5])  # a row's draw is its own, whatever the batch


# ------------------------------------------------------------------ the three-phase run
@pytest.fixture(scope='module')
def recorded(fed):
  return record_rounds(fed, fed.init(), fed.total_rounds)


@pytest.fixture(scope='module')
def uninterrupted(recorded):
  return recorded.states[-1], recorded.history


def test_the_run_has_its_three_phases_and_the_finetune_trains_on_s_times_c_rows(fed, uninterrupted):
  _, history = uninterrupted
  assert fed.total_rounds == 3 and [m['phase'] for m in history] == ['fl', 'vtc_exchange', 'finetune']
  psi = sum(x.size for x in jax.tree.leaves(fed.init().groups[0].extra.psi)) // 4  # per client
  assert history[1]['upload_scalars'] == 4 * psi and history[1]['broadcast_scalars'] == 0
  assert history[2]['upload_scalars'] == 0 and history[2]['local_steps'] == 4 * (8 * 10 // 32) * 2
  assert history[0]['upload_sigma_scalars'] == 2 * 80  # two participants (join ratio 0.5); then all four
  assert all(np.isfinite(m['train_loss']) for m in history)


def test_resume_across_the_finetune_boundary_equals_the_uninterrupted_run(fed, recorded, uninterrupted, tmp_path):
  checkpoints = Checkpoints(str(tmp_path / 'ckpt'))
  checkpoints.save(recorded.states[1])  # at the end of 'vtc_exchange'
  restored = checkpoints.restore(fed.init(), 2)
  state, rest = run_rounds(fed, restored, 1)
  tree_allclose(state.groups, uninterrupted[0].groups, rtol=0, atol=0)
  assert recorded.history[:2] + rest == uninterrupted[1]


@pytest.mark.slow
def test_the_experiment_reports_accuracy_before_and_after_finetuning_and_draws_samples(tmp_path, uninterrupted):
  summary = train_and_evaluate(CFG, str(tmp_path), progress=False)
  before_after = summary['final_accuracy_by_phase']
  assert set(before_after) == {'fl', 'vtc_exchange', 'finetune'} and summary['finished']
  assert before_after['vtc_exchange'] == pytest.approx(uninterrupted[1][1]['accuracy'])
  assert before_after['finetune'] == pytest.approx(uninterrupted[1][2]['accuracy'])
  assert os.path.getsize(tmp_path / 'samples.png') > 0
  with pytest.raises(ConfigError, match='--rounds=2'):  # FedVTC's phases hang on --rounds
    train_and_evaluate(dataclasses.replace(CFG, rounds=2), str(tmp_path), resume=True, progress=False)


def test_every_round_ablation_keeps_the_servers_decoder_for_fine_tuning():
  """Table 3 (2): with psi averaged every round, no closing exchange of every client's (mostly stale) local psi
  replaces the server's last average: the run goes from 'fl' straight to 'finetune'."""
  from fedjax_het.methods.fedvtc import FedVTCConfig, fedvtc
  names = lambda cfg: [p.name for p in fedvtc(cfg, 10, 3).phases]
  assert names(FedVTCConfig(every_round=True)) == ['fl', 'finetune']
  assert names(FedVTCConfig()) == ['fl', 'vtc_exchange', 'finetune']


def test_a_participant_receives_the_prototypes_of_the_classes_it_holds():
  """Down-link per participant: |Y_k| p (c^y only to holders of y, among the classes with a global prototype),
  plus sigma; the exchange round's broadcast is counted as it is."""
  from fedjax_het.methods.fedvtc import VTCMessage, fedvtc
  alg = fedvtc(FedVTCConfig(), 3, 2)
  broadcast = VTCMessage(jnp.ones((3, 4)), jnp.array([True, True, False]), jnp.ones(4))
  upload = VTCUpload(jnp.zeros((3, 4)), jnp.array([3.0, 0.0, 5.0]), jnp.ones(4))
  got = {k: int(v) for k, v in alg.phases[0].traffic.received(broadcast, upload).items()}
  assert got == {'prototypes': 4, 'sigma': 4}  # class 0 only: class 1 not held, class 2 has no prototype yet
  assert alg.phases[0].traffic.received(VTCMessage(), VTCUpload(psi={'w': jnp.ones(1)})) == {}
