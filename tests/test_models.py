import jax
import jax.numpy as jnp
import pytest

from fedjax_het.engine.forward import forward
from fedjax_het.errors import ConfigError
from fedjax_het.models import assign_models, build_model, model_names


@pytest.mark.parametrize('name,shape', [('cnn4', (32, 32, 3)), ('resnet18', (32, 32, 3)), ('small_cnn', (8, 8, 1)),
                                        ('mlp', (8, 8, 1)), ('resnet10', (16, 16, 3))])
@pytest.mark.parametrize('rm', ['ap', 'mp', 'fc'])
def test_every_model_maps_to_d_and_shares_the_head_shape(name, shape, rm):
  model = build_model(name, num_classes=7, feature_dim=24, rm=rm)
  x = jnp.ones((2,) + shape)
  variables = model.init(jax.random.PRNGKey(0), x)
  params = variables.pop('params')
  logits, rep, state = forward(model, params, dict(variables), x, train=True)
  assert logits.shape == (2, 7) and rep.shape == (2, 24)
  assert params['head']['kernel'].shape == (24, 7)
  assert ('rm_fc' in params) == (rm == 'fc')


def test_cnn4_parameter_count_matches_htfllib():
  # HtFLlib FedAvgCNN(in_features=3, num_classes=10, dim=1600): conv 3*32*25+32, conv 32*64*25+64,
  # fc1 1600*512+512, fc 512*10+10 = 2432 + 51264 + 819712 + 5130 = 878538.
  model = build_model('cnn4', 10, 512)
  params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 32, 32, 3)))['params']
  assert sum(a.size for a in jax.tree.leaves(params)) == 878538


def test_resnet18_parameter_count_matches_torchvision():
  # torchvision resnet18(num_classes=10): 11,181,642 parameters (11,689,512 with the 1000-class fc,
  # minus 512*1000+1000, plus 512*10+10).
  model = build_model('resnet18', 10, 512)
  params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 32, 32, 3)))['params']
  assert sum(a.size for a in jax.tree.leaves(params)) == 11181642


def test_model_family_assignment_and_errors():
  assert assign_models(['a', 'b', 'c'][:2] and ['cnn4', 'mlp'], 5) == ['cnn4', 'mlp', 'cnn4', 'mlp', 'cnn4']
  with pytest.raises(ConfigError, match='unknown model'):
    assign_models(['cnn4', 'vgg99'], 3)
  with pytest.raises(ConfigError, match='--rm'):
    build_model('mlp', 10, 8, rm='avg').init(jax.random.PRNGKey(0), jnp.ones((1, 4, 4, 1)))
  assert {'cnn4', 'resnet18', 'resnet34'} <= set(model_names())
