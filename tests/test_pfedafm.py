"""pFedAFM: the feature mixture by hand, what each of its two local stages trains, the mixing weights kept in
[0, 1], and the server's row-weighted average of G. (vmap == sequential and its pinned numbers:
tests/test_golden.py; resume == uninterrupted: tests/test_seed_baselines.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_het.core import Batch, Uploads
from fedjax_het.errors import ConfigError
from fedjax_het.methods import PFedAFMConfig
from fedjax_het.methods.pfedafm import mix
from fedjax_het.methods.shared.global_model import GlobalModel
from fedjax_het.run.config import ExperimentConfig
from fedjax_het.run.experiment import build_federation
from fedjax_het.uploads import RoundUploads


def _federation(**methods):
  cfg = ExperimentConfig(algorithm='pfedafm', dataset='synthetic:8,8,1', data_fraction=0.1, num_clients=4,
                         models=('mlp',), feature_dim=16, rounds=2, batch_size=8, local_learning_rate=0.05,
                         partition='iid', methods={'pfedafm': PFedAFMConfig(**{'global_model': 'small_cnn_narrow',
                                                                                **methods})})
  return build_federation(cfg)


def test_the_mixture_by_hand():
  # alpha [1, 0, 0.25] of own [4, 4, 4] and shared [0, 8, 8]: [4, 8, 0.25 * 4 + 0.75 * 8 = 7]
  got = mix(jnp.array([1.0, 0.0, 0.25]), jnp.array([[4.0, 4.0, 4.0]]), jnp.array([[0.0, 8.0, 8.0]]))
  np.testing.assert_allclose(got, [[4.0, 8.0, 7.0]])


def test_stage_one_trains_the_own_model_and_alpha_stage_two_only_g():
  fed = _federation(alpha_learning_rate=50.0)  # a huge rate: alpha must still stay in [0, 1]
  state = fed.init()
  g = fed.groups[0]
  program = fed.programs[0][0]
  client = jax.jit(lambda s: jax.tree.map(lambda a: a[0], s))(state.groups[0])
  broadcast = fed.broadcast(state.server, 0, 0)
  batch = Batch(g.train.x[0, :8], g.train.y[0, :8], jnp.arange(8), None)
  # Jitted, as the engine runs them (one program each, not an eager op per layer).
  carry = jax.jit(program.init)(client, broadcast, jax.random.PRNGKey(0))
  one, _ = jax.jit(program.stages[0].step)(carry, batch, broadcast, jax.random.PRNGKey(1))
  two, _ = jax.jit(program.stages[1].step)(one, batch, broadcast, jax.random.PRNGKey(2))
  changed = lambda a, b: any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  own, alpha, shared = (lambda c: c[0].params), (lambda c: c[0].extra.alpha), (
      lambda c: c[0].extra.params['companion'])
  assert changed(own(carry), own(one)) and changed(alpha(carry), alpha(one)) and not changed(shared(carry), shared(one))
  assert changed(shared(one), shared(two)) and not changed(own(one), own(two)) and not changed(alpha(one), alpha(two))
  assert float(alpha(one).min()) >= 0.0 and float(alpha(one).max()) <= 1.0
  assert float(alpha(one).min()) < 1.0  # it moved off its initial ones


def test_the_server_averages_g_weighted_by_training_rows():
  fed = _federation()
  state = fed.init()
  template = state.server.global_model
  copies = jax.tree.map(lambda a: jnp.stack([jnp.full_like(a, 1.0), jnp.full_like(a, 3.0), jnp.full_like(a, 9.0)]),
                        template)
  uploads = (Uploads(GlobalModel(copies), jnp.array([True, True, False]), jnp.array([30.0, 10.0, 50.0])),)
  new, _ = fed.algorithm.phases[0].server_update(state.server, RoundUploads(uploads), jax.random.PRNGKey(0))
  for leaf in jax.tree.leaves(new.global_model):  # (30 * 1 + 10 * 3) / 40; the absent slot not counted
    np.testing.assert_allclose(leaf, 1.5, rtol=1e-6)


def test_bad_settings_name_their_fields():
  with pytest.raises(ConfigError, match='PFedAFMConfig.momentum=1.0'):
    PFedAFMConfig(momentum=1.0)
  with pytest.raises(ConfigError, match="--global_model='nope' is not a registered model"):
    _federation(global_model='nope')


def test_g_trains_with_the_codes_weight_decay_by_hand():
  """The code steps G by SGD(lr, momentum 0.9, weight_decay=wd) (its optimizer_small): a zero gradient still moves
  G by -lr * wd * G; lr 0.1, wd 1e-3, G = (2, -4): (-2e-4, 4e-4). Its own model's optimiser the same."""
  from fedjax_het.methods.pfedafm import optimizers
  params = jnp.asarray([2.0, -4.0])
  for opt in optimizers(PFedAFMConfig(weight_decay=1e-3), 0.1)[::2]:
    np.testing.assert_allclose(opt.update(jnp.zeros(2), opt.init(params), params)[0], [-2e-4, 4e-4], rtol=1e-6)
