"""The MND memorisation ratio ("GeFL: Model-Agnostic Federated Learning with Generative Models", Eq. 1) against
hand-computed toy values, and its invariances."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_het.errors import ConfigError
from fedjax_het.evaluation.mnd import embedding, mnd_ratio, nearest_distances
from fedjax_het.run.config import ExperimentConfig


def test_mnd_ratio_on_the_toy_points():
  """d = |a - b| in 1-D: train {0}, V {2}, S {1} -> 2.0; train {0, 10}, V {1, 12}, S {3, 10.5} -> mean(1/3, 4)."""
  col = lambda *v: jnp.asarray(v, jnp.float32)[:, None]
  assert mnd_ratio(col(0), col(2), col(1))[0] == pytest.approx(2.0)
  mean, per_point = mnd_ratio(col(0, 10), col(1, 12), col(3, 10.5))
  assert mean == pytest.approx(13 / 6) and per_point == pytest.approx([1 / 3, 4.0])


def test_copies_of_training_points_give_a_huge_ratio_and_chunking_changes_nothing():
  x = jax.random.normal(jax.random.PRNGKey(0), (37, 5))
  v = jax.random.normal(jax.random.PRNGKey(1), (11, 5))
  assert mnd_ratio(x[:5], v, x)[0] > 1e3  # S holds the training points themselves: memorisation
  np.testing.assert_allclose(nearest_distances(x, v, chunk=4), nearest_distances(x, v, chunk=256), rtol=1e-5)
  brute = np.sqrt(((np.asarray(x)[:, None] - np.asarray(v)[None]) ** 2).sum(-1)).min(1)
  np.testing.assert_allclose(nearest_distances(x, v, chunk=8), brute, rtol=1e-4)


def test_feature_distance_is_a_fixed_map_and_unknown_distances_are_named():
  images = jax.random.uniform(jax.random.PRNGKey(2), (3, 32, 32, 1))
  np.testing.assert_array_equal(embedding('feature', (32, 32, 1))(images), embedding('feature', (32, 32, 1))(images))
  with pytest.raises(ConfigError, match='--distance'):
    embedding('lpips', (32, 32, 1))


def test_a_config_round_trips_through_its_json_dict():
  from fedjax_het.methods import GeFLConfig
  cfg = ExperimentConfig(algorithm='gefl', models=('mlp', 'cnn4'), image_size=32,
                         methods={'gefl': GeFLConfig(generator='cvae', width=8)})
  assert ExperimentConfig.from_dict(cfg.to_dict()) == cfg

