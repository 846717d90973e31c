"""Data augmentation on device (fedjax_het.data.augment): the crop and flip and the Cutout by hand, the draws, and
in a run the same numbers under vmap and sequential and from the same seed."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_het.data import make_federated_data, make_synthetic
from fedjax_het.data.augment import augment_batch, crop_and_flip, cutout, random_crop_flip
from fedjax_het.data.datasets import black_pixel
from fedjax_het.engine import ExecutionConfig, Federation, LocalTraining, ModelConfig
from fedjax_het.errors import ConfigError
from fedjax_het.run.config import ExperimentConfig
from fedjax_het.run.experiment import make_algorithm

from golden import TINY


def test_a_crop_of_the_padded_image_and_its_mirror_by_hand():
  """The 4x4 image 1..16 padded by one pixel of -1, the window at row 0, column 2 of the padded 6x6: its first row
  is padding, then rows 1-3 of the image from column 1 with padding on the right; flipped, mirrored."""
  x = jnp.arange(1.0, 17.0).reshape(1, 4, 4, 1)
  window = [[-1, -1, -1, -1], [2, 3, 4, -1], [6, 7, 8, -1], [10, 11, 12, -1]]
  got = crop_and_flip(x, jnp.asarray([0]), jnp.asarray([2]), jnp.asarray([False]), 1, -1.0)
  np.testing.assert_array_equal(got[0, ..., 0], window)
  flipped = crop_and_flip(x, jnp.asarray([0]), jnp.asarray([2]), jnp.asarray([True]), 1, -1.0)
  np.testing.assert_array_equal(flipped[0, ..., 0], np.asarray(window)[:, ::-1])
  centre = crop_and_flip(x, jnp.asarray([1]), jnp.asarray([1]), jnp.asarray([False]), 1, -1.0)
  np.testing.assert_array_equal(centre, x)


def test_offsets_cover_zero_to_twice_the_padding_and_half_the_images_flip():
  """Padding 4 on 1x1 images of one marked pixel: the pixel lands at each of the 81 offsets (9 x 9), and an
  asymmetric 1x2 image is mirrored in about half the draws; the same key draws the same."""
  x = jnp.zeros((4000, 9, 9, 1)).at[:, 4, 4, 0].set(1.0)
  out = random_crop_flip(x, jax.random.PRNGKey(0), 4, 0.0)
  where = np.argwhere(np.asarray(out[..., 0]) == 1.0)
  counts = np.zeros((9, 9))
  np.add.at(counts, (where[:, 1], where[:, 2]), 1)
  assert (counts > 0).all() and counts.sum() == 4000 and counts.max() < 2 * 4000 / 81
  pair = jnp.tile(jnp.asarray([[[[0.0], [1.0]]]]), (4000, 1, 1, 1))
  mirrored = random_crop_flip(pair, jax.random.PRNGKey(1), 0, 0.0)[:, 0, 0, 0] == 1.0
  assert float(mirrored.mean()) == pytest.approx(0.5, abs=0.03)
  np.testing.assert_array_equal(random_crop_flip(x[:8], jax.random.PRNGKey(2)),
                                random_crop_flip(x[:8], jax.random.PRNGKey(2)))


def test_cutout_zeroes_the_square_around_its_centre_clipped_at_the_borders_by_hand():
  """Length 4 on a 6 x 6 image of ones: centre (0, 3) zeroes rows 0-1 (-2 and -1 clipped) and columns 1-4; centre
  (5, 5) rows 3-5 and columns 3-5 (FedGKT's loader: y1 = clip(y - 2), y2 = clip(y + 2))."""
  x = jnp.ones((2, 6, 6, 2))
  got = np.asarray(cutout(x, jnp.asarray([0, 5]), jnp.asarray([3, 5]), 4))
  first = np.ones((6, 6))
  first[0:2, 1:5] = 0
  second = np.ones((6, 6))
  second[3:6, 3:6] = 0
  np.testing.assert_array_equal(got[0, ..., 0], first)
  np.testing.assert_array_equal(got[1, ..., 1], second)


def test_crop_flip_cutout_cuts_a_square_of_up_to_16_by_16_from_every_image():
  """On 32 x 32 images of ones with no padding effect (fill 1), every image loses between 8 x 8 (a corner centre)
  and 16 x 16 pixels; the centres cover the image (a cut reaches every row); 'crop_flip' cuts nothing."""
  x = jnp.ones((500, 32, 32, 1))
  out = np.asarray(augment_batch(x, jax.random.PRNGKey(0), 'crop_flip_cutout', (1.0,)))[..., 0]
  cut = (out == 0).sum(axis=(1, 2))
  assert cut.min() >= 64 and cut.max() == 256 and (out == 0).any(axis=(0, 2)).all()
  assert (np.asarray(augment_batch(x, jax.random.PRNGKey(0), 'crop_flip', (1.0,))) == 1).all()


def test_the_padding_is_a_black_pixel_of_the_runs_normalisation():
  assert black_pixel('symmetric') == (-1.0,)
  np.testing.assert_allclose(black_pixel('cifar10'), [-0.4914 / 0.2023, -0.4822 / 0.1994, -0.4465 / 0.2010])
  with pytest.raises(ConfigError, match="LocalTraining.augment='rotate' is unknown; choose one of none, crop_flip"):
    LocalTraining(augment='rotate')


def federation(strategy: str, augment: str, seed: int = 0) -> Federation:
  data = make_federated_data(make_synthetic(num_samples=320, image_shape=(8, 8, 1), num_classes=4, noise=0.3, seed=1),
                             num_clients=4, partition='dirichlet', seed=3, alpha=0.5)
  cfg = ExperimentConfig(algorithm='fedavg', **{**TINY, 'rounds': 2, 'feature_dim': 16})
  return Federation(make_algorithm(cfg, data), data, ModelConfig(('small_cnn_narrow',), 16),
                    LocalTraining(0.05, 8, 1, augment=augment), ExecutionConfig(strategy=strategy, conv='xla'),
                    rounds=2, seed=seed)


def final_state(fed: Federation):
  state = fed.init()
  for _ in range(2):
    state, _ = fed.round(state)
  return [np.asarray(a) for a in jax.tree.leaves(state.groups)]


# crop_flip_cutout crops and flips too: the plain crop_flip run only in -m slow
@pytest.mark.parametrize('augment', [pytest.param('crop_flip', marks=pytest.mark.slow), 'crop_flip_cutout'])
def test_augmented_runs_are_the_same_under_vmap_and_sequential_and_from_the_same_seed(augment):
  sequential, vmapped = final_state(federation('sequential', augment)), final_state(federation('vmap', augment))
  for a, b in zip(sequential, vmapped):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
  again = final_state(federation('sequential', augment))
  assert all(np.array_equal(a, b) for a, b in zip(sequential, again))
  plain = final_state(federation('sequential', 'none'))
  assert not all(np.allclose(a, b) for a, b in zip(sequential, plain))  # the augmentation took effect


def test_an_augmentation_that_can_erase_the_images_is_refused_naming_the_flag_and_the_size(tmp_path, monkeypatch):
  """Cutout(16) on 8x8 digits erased every image (accuracy at chance, the run 'finished'); a 4-pixel crop padding
  on images of 4 pixels can hold only padding. Refused: as the config is made where --image_size gives the size,
  else once the dataset is loaded, before anything is written or compiled. A crop shifting small images by a
  quarter of their side or more runs, with a caution."""
  from absl import flags
  from fedjax_het.data.augment import check_augmentation
  from fedjax_het.engine.federation import Federation
  from fedjax_het.run import cli
  assert check_augmentation('none', (1, 1)) is None and check_augmentation('crop_flip_cutout', (17, 17)) is None
  assert check_augmentation('crop_flip_cutout', (32, 20)) is None  # no cut reaches across 32 rows
  assert check_augmentation('crop_flip', (17, 17)) is None and 'a quarter of its side' in check_augmentation(
      'crop_flip', (16, 16, 3))
  for kind, shape, reason in (('crop_flip_cutout', (8, 8, 1), 'every cut erases the whole image'),
                              ('crop_flip_cutout', (16, 16), 'a cut can erase the whole image'),
                              ('crop_flip_cutout', (12, 16), 'a cut can erase the whole image'),
                              ('crop_flip', (4, 32), 'a crop can hold no pixel of the image')):
    with pytest.raises(ConfigError, match=rf"^LocalTraining.augment='{kind}' on {shape[0]}x{shape[1]} images: .*"
                                          rf"{reason}\. Fix: LocalTraining.augment='none', or images resized to "
                                          rf"32 x 32 first \(Dataset.resized\(32\)\)"):
      check_augmentation(kind, shape)
  with pytest.raises(ConfigError, match=r"^--augment='crop_flip_cutout' on 8x8 images: .* Fix: --augment='none', "
                                        r'or images resized to 32 x 32 first \(--image_size=32\)'):
    ExperimentConfig(dataset='mnist', image_size=8, augment='crop_flip_cutout')  # no data read yet
  monkeypatch.setattr(Federation, '__init__', lambda *a, **k: pytest.fail('built before the images were checked'))
  fv = flags.FlagValues()
  cli.define_flags(flag_values=fv)
  cli.parse_flags(['prog', '--dataset=digits', '--models=mlp', '--rounds=1', f'--workdir={tmp_path}',
                   '--noprogress', '--augment=crop_flip_cutout'], fv)  # digits: 8x8, known once loaded
  with pytest.raises(ConfigError, match=r"^--augment='crop_flip_cutout' on 8x8 images: its 16x16 Cutout square is "
                                        r'not smaller than the image, so every cut erases the whole image\. Fix: '
                                        r"--augment='none', or images resized to 32 x 32 first \(--image_size=32\)"):
    cli.run(fv)
  assert os.listdir(tmp_path) == ['.lock']
