"""HtFLlib's initialisation: PyTorch's default Conv/Linear draws, clients of one architecture identical."""

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import compilations
from fedjax_het.core import ClientState
from fedjax_het.engine import ExecutionConfig, Federation, LocalTraining, ModelConfig
from fedjax_het.errors import ConfigError
from fedjax_het.methods import fedavg_grouped, local
from fedjax_het.methods.fedavg import GroupModel, receive_group_model
from fedjax_het.models.init import torch_default_init


def test_torch_default_init_has_the_reference_bounds_and_leaves_norms_alone():
  params = {'dense': {'kernel': jnp.zeros((300, 200)), 'bias': jnp.zeros(200)},
            'conv': {'kernel': jnp.zeros((5, 5, 3, 64)), 'bias': jnp.zeros(64)},
            'norm': {'scale': jnp.ones(8), 'bias': jnp.zeros(8)},
            'attention': {'kernel': jnp.zeros((4, 2, 3))}}
  out = torch_default_init(params, jax.random.PRNGKey(0))
  for name, fan_in in (('dense', 300), ('conv', 5 * 5 * 3)):
    bound = 1 / math.sqrt(fan_in)
    for leaf in ('kernel', 'bias'):
      a = np.asarray(out[name][leaf])
      assert np.abs(a).max() <= bound and np.abs(a).max() > 0.95 * bound
  w = np.asarray(out['dense']['kernel'])
  np.testing.assert_allclose(w.mean(), 0, atol=3e-4)
  np.testing.assert_allclose(w.var(), (1 / 300) / 3, rtol=0.02)  # U(-b, b) has variance b^2 / 3
  np.testing.assert_array_equal(out['norm']['scale'], 1)
  np.testing.assert_array_equal(out['norm']['bias'], 0)
  np.testing.assert_array_equal(out['attention']['kernel'], 0)
  again = torch_default_init(params, jax.random.PRNGKey(0))
  np.testing.assert_array_equal(again['conv']['kernel'], out['conv']['kernel'])


def test_each_layer_is_its_own_uniform_draw_from_a_key_of_its_path():
  # The documented draw, written out: kernel and bias from the two keys of split(fold_in(key, crc32(path))), as
  # jax.random.uniform draws them; one layer spans several blocks of the hashed stream, one is a transposed
  # convolution (fan_in = kh * kw * out), and a batch of keys (vmap) gives each its own.
  params = {'a': {'kernel': jnp.zeros((3, 3, 16, 200)), 'bias': jnp.zeros(200)},  # 28,800 weights: 29 blocks
            'b': {'Dense_0': {'kernel': jnp.zeros((7, 5))}},
            'up': {'convt1': {'kernel': jnp.zeros((4, 4, 6, 3)), 'bias': jnp.zeros(3)}}}
  keys = jax.random.split(jax.random.PRNGKey(5), 3)
  out = jax.jit(jax.vmap(torch_default_init, in_axes=(None, 0)))(params, keys)
  for c, key in enumerate(keys):
    for path, fan_in in ((('a',), 3 * 3 * 16), (('b', 'Dense_0'), 7), (('up', 'convt1'), 4 * 4 * 3)):
      k_key, b_key = jax.random.split(jax.random.fold_in(key, zlib.crc32('/'.join(path).encode()) & 0x7FFFFFFF))
      layer, got = params, out
      for name in path:
        layer, got = layer[name], got[name]
      bound = 1 / math.sqrt(fan_in)
      np.testing.assert_array_equal(got['kernel'][c], jax.random.uniform(k_key, layer['kernel'].shape,
                                                                         jnp.float32, -bound, bound))
      if 'bias' in layer:
        np.testing.assert_array_equal(got['bias'][c], jax.random.uniform(b_key, layer['bias'].shape, jnp.float32,
                                                                         -bound, bound))


def test_torch_default_init_matches_torch_linear_moments():
  torch = pytest.importorskip('torch')
  torch.manual_seed(0)
  layer = torch.nn.Linear(300, 200)
  ours = torch_default_init({'l': {'kernel': jnp.zeros((300, 200)), 'bias': jnp.zeros(200)}},
                            jax.random.PRNGKey(1))['l']
  for theirs, mine in ((layer.weight.detach().numpy(), ours['kernel']), (layer.bias.detach().numpy(), ours['bias'])):
    mine = np.asarray(mine)
    assert abs(np.abs(theirs).max() - np.abs(mine).max()) < 2e-3
    np.testing.assert_allclose(mine.std(), theirs.std(), rtol=0.15 if mine.size < 1000 else 0.02)


def _params(fed, state, gi):
  return [np.concatenate([np.ravel(a[i]) for a in jax.tree.leaves(state.groups[gi].params)])
          for i in range(fed.groups[gi].size)]


def test_clients_of_one_architecture_start_identical_unless_asked_otherwise(tiny_data):
  kw = dict(execution=ExecutionConfig('sequential', 'xla', eval_batch_size=16))
  training = LocalTraining(0.05, 8, 1)
  shared = Federation(local(4), tiny_data, ModelConfig(['small_cnn_narrow', 'mlp'], 16), training, **kw)
  state = shared.init()
  for gi in range(2):
    p = _params(shared, state, gi)
    assert all(np.array_equal(p[0], q) for q in p[1:])
  a, b = _params(shared, state, 0)[0], _params(shared, state, 1)[0]
  assert a.shape != b.shape or not np.array_equal(a, b)
  own = Federation(local(4), tiny_data, ModelConfig(['small_cnn_narrow', 'mlp'], 16, init='flax', shared_init=False),
                   training, **kw)
  p = _params(own, own.init(), 0)
  assert not np.array_equal(p[0], p[1])
  # Grouped FedAvg starts each group from one model even without shared_init (PFLlib broadcasts first): the
  # server's group model, which every participant receives before its first step.
  avg = Federation(fedavg_grouped(4), tiny_data, ModelConfig(['small_cnn_narrow', 'mlp'], 16, shared_init=False),
                   training, **kw)
  state = avg.init()
  assert all(np.array_equal(a, b[0]) for a, b in zip(jax.tree.leaves(state.server.models[1]),
                                                     jax.tree.leaves(state.groups[1].params)))
  with pytest.raises(ConfigError, match="ModelConfig.init='xavier'"):
    Federation(local(4), tiny_data, ModelConfig(['mlp'], 16, init='xavier'), training, **kw)


def test_a_federation_traces_each_classifier_once_to_check_and_initialise_it(tiny_data, monkeypatch):
  """The architecture check (`check_architecture`, at construction) and the initialiser (`init`) share one trace
  of each classifier's forward pass on one image, the dearest part of a deep model's initialisation to trace."""
  from fedjax_het.models.classifier import HeteroClassifier
  traced = []
  represent = HeteroClassifier.represent
  monkeypatch.setattr(HeteroClassifier, 'represent',
                      lambda self, x, train=False: traced.append(x.shape[0]) or represent(self, x, train))
  # A seed and width no other test uses: nothing of these classifiers is traced or cached in the process yet.
  fed = Federation(local(4), tiny_data, ModelConfig(['small_cnn_narrow', 'mlp'], 11),
                   LocalTraining(0.05, 8, 1), ExecutionConfig('sequential', 'xla', eval_batch_size=16), seed=7211)
  assert traced.count(1) == 2  # one image: the check's trace of each architecture
  jax.block_until_ready(fed.init())
  assert traced.count(1) == 2, traced  # init reused them


def test_grouped_fedavg_sends_parameters_and_keeps_batchnorm_statistics_local():
  client = ClientState({'w': jnp.array([1., 2.])}, {'batch_stats': {'mean': jnp.array([5.])}}, {}, jnp.zeros(2))
  received = receive_group_model(client, GroupModel({'w': jnp.array([2.5, 3.5])}))
  np.testing.assert_allclose(received.params['w'], [2.5, 3.5])
  np.testing.assert_array_equal(received.model_state['batch_stats']['mean'], [5.])


# FedGKT's and FedGen's (the same check, of other models) in -m slow.
@pytest.mark.parametrize('method', [pytest.param('fedgkt', marks=pytest.mark.slow),
                                    pytest.param('fedgen', marks=pytest.mark.slow), 'velo'])
def test_a_server_model_is_initialised_in_one_program(method):
  """FedGKT's server ResNet, FedGen's generator and Velo's CVAE: a program each, not an eager op per layer. With
  caches cleared, init_server compiles 29 / 3 / 14 programs (the optimizers' and buffers' zeros stay eager); op by
  op it compiled 124 / 57 / 69."""
  from golden import make_golden_federation
  fed = make_golden_federation(method)
  initial = [jax.tree.map(np.asarray, g) for g in fed.init().groups]
  jax.clear_caches()  # what the first init compiled is compiled again, eagerly op by op if it were eager
  with compilations() as compiled:
    jax.block_until_ready(fed.algorithm.init_server(jax.random.PRNGKey(0), fed.spec, initial))
  assert len(compiled) <= 35, compiled
