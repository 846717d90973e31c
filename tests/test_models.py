import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_het.errors import ConfigError
from fedjax_het.models import assign_models, build_model, model_names
from fedjax_het.models.forward import forward


@pytest.mark.parametrize('name,shape', [('cnn4', (32, 32, 3)), ('resnet18', (32, 32, 3)), ('small_cnn', (8, 8, 1)),
                                        ('mlp', (8, 8, 1)), ('resnet10', (16, 16, 3))])
@pytest.mark.parametrize('rm', ['ap', 'mp', 'fc'])
def test_every_model_maps_to_d_and_shares_the_head_shape(name, shape, rm):
  model = build_model(name, num_classes=7, feature_dim=24, rm=rm)
  x = jnp.ones((2,) + shape)
  logits, rep, params = jax.eval_shape(lambda: _init_and_train_forward(model, x))
  assert logits.shape == (2, 7) and rep.shape == (2, 24)
  assert params['head']['kernel'].shape == (24, 7)
  assert ('rm_fc' in params) == (rm == 'fc')


def _init_and_train_forward(model, x):
  variables = model.init(jax.random.PRNGKey(0), x)
  params = variables.pop('params')
  logits, rep, _ = forward(model, params, dict(variables), x, train=True)
  return logits, rep, params


def test_cnn4_parameter_count_matches_htfllib():
  # HtFLlib FedAvgCNN(in_features=3, num_classes=10, dim=1600): conv 3*32*25+32, conv 32*64*25+64,
  # fc1 1600*512+512, fc 512*10+10 = 2432 + 51264 + 819712 + 5130 = 878538.
  model = build_model('cnn4', 10, 512)
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.ones((1, 32, 32, 3))))['params']
  assert sum(a.size for a in jax.tree.leaves(params)) == 878538


def test_resnet18_parameter_count_matches_torchvision():
  # torchvision resnet18(num_classes=10): 11,181,642 parameters (11,689,512 with the 1000-class fc,
  # minus 512*1000+1000, plus 512*10+10).
  model = build_model('resnet18', 10, 512)
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.ones((1, 32, 32, 3))))['params']
  assert sum(a.size for a in jax.tree.leaves(params)) == 11181642


# Extractor parameters = the PyTorch original minus its classifier. Totals printed with torchvision 0.28.0 /
# torch 2.13.0: sum(p.numel()) of torchvision.models.<name>(num_classes=10) (googlenet with aux_logits=False,
# vit_b_16/vit_b_32 with image_size=32; resnet10 = torchvision ResNet(BasicBlock, [1, 1, 1, 1]), HtFLlib's), minus
# the final Linear(L, 10): resnet18 11,181,642 - 5,130; resnet34 21,289,802 - 5,130; resnet10 4,910,922 - 5,130;
# resnet50 23,528,522 - 20,490; resnet101 42,520,650 - 20,490; resnet152 58,164,298 - 20,490; mobilenet_v2
# 2,236,682 - 12,810; googlenet 5,610,154 - 10,250; vit_b_16 85,658,890 - 7,690; vit_b_32 87,426,058 - 7,690.
# resnet14 / 22 / 26 (Felo's family, BasicBlock stages (1,1,2,2), (2,2,3,3), (3,3,3,3)) by hand from the block
# sizes these totals imply: a 512-wide BasicBlock adds 4,720,640, a 256-wide one 1,180,672, a 128-wide 295,424 and a
# 64-wide 73,984 to the stage's first block.
TORCHVISION_EXTRACTOR_PARAMS = {
    'resnet14': 10807104, 'resnet22': 17077824, 'resnet26': 17447232,
    'resnet10': 4905792, 'resnet18': 11176512, 'resnet34': 21284672, 'resnet50': 23508032, 'resnet101': 42500160,
    'resnet152': 58143808, 'mobilenet_v2': 2223872, 'googlenet': 5599904, 'vit_b16': 85651200,
    'vit_b32': 87418368,
}


@pytest.mark.parametrize('name', sorted(TORCHVISION_EXTRACTOR_PARAMS))
def test_extractor_parameter_counts_match_the_pytorch_originals(name):
  model = build_model(name, 10, 512)
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3))))['params']
  count = lambda tree: sum(a.size for a in jax.tree.leaves(tree))
  assert count(params['extractor']) == TORCHVISION_EXTRACTOR_PARAMS[name]
  assert count(params) == TORCHVISION_EXTRACTOR_PARAMS[name] + 512 * 10 + 10


@pytest.mark.parametrize('name', ['mobilenet_v2', 'googlenet', 'resnet50', 'resnet4'])
@pytest.mark.parametrize('size', [32, pytest.param(64, marks=pytest.mark.slow)])
def test_zoo_models_take_32_and_64_pixel_images(name, size):
  """Shapes by abstract tracing (jax.eval_shape): compiling these models on CPU only to read shapes is slow."""
  model = build_model(name, num_classes=5, feature_dim=16, conv='auto')
  x = jnp.ones((2, size, size, 3))

  def init_and_forward():
    variables = model.init(jax.random.PRNGKey(0), x)
    params = variables.pop('params')
    return forward(model, params, dict(variables), x, train=True)
  logits, rep, state = jax.eval_shape(init_and_forward)
  assert logits.shape == (2, 5) and rep.shape == (2, 16)
  assert set(state) == {'batch_stats'}


def test_vit_position_table_follows_the_image_size():
  for size, tokens in [(32, 5), (64, 17)]:
    model = build_model('vit_b16', 10, 512)
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, size, size, 3))))['params']
    assert params['extractor']['pos_embedding'].shape == (1, tokens, 768)


def test_ceil_mode_max_pool_matches_torch():
  torch = pytest.importorskip('torch')
  from fedjax_het.models.googlenet import max_pool_ceil
  x = np.random.default_rng(0).normal(size=(2, 15, 16, 3)).astype(np.float32)
  for window, stride, pad in [(3, 2, 0), (2, 2, 0), (3, 1, 1), (3, 2, 1)]:
    ref = torch.nn.MaxPool2d(window, stride, pad, ceil_mode=True)(torch.from_numpy(x.transpose(0, 3, 1, 2)))
    np.testing.assert_array_equal(np.asarray(max_pool_ceil(jnp.asarray(x), window, stride, pad)),
                                  ref.numpy().transpose(0, 2, 3, 1))


def test_model_families_expand_in_htfllib_order():
  assert assign_models(['HtFE-img-4'], 6) == ['cnn4', 'googlenet', 'mobilenet_v2', 'resnet18', 'cnn4', 'googlenet']
  assert len(assign_models(['HtM-img-10'], 10)) == 10 and len(set(assign_models(['fedre-10'], 10))) == 10
  assert set(assign_models(['HtM-img-10'], 10)) == set(assign_models(['fedre-10'], 10))


@pytest.mark.parametrize('dataset,channels', [('mnist', 1), ('fmnist', 1), ('cifar10', 3)])
def test_gefl_cnns_flatten_to_the_tables_fc_widths(dataset, channels):
  # "GeFL: Model-Agnostic Federated Learning with Generative Models", Tables XXI-XXIII: the final layers are fc(1024/10)
  # ... fc(80/10) for CNN-1 ... CNN-10 (32x32 inputs).
  widths = []
  for k in range(1, 11):
    extractor = build_model(f'gefl_{dataset}_cnn{k}', 10, 16).extractor
    out, _ = jax.eval_shape(lambda: extractor.init_with_output(jax.random.PRNGKey(0),
                                                                jnp.zeros((1, 32, 32, channels))))
    widths.append(out.shape[-1])
  assert widths == [1024, 512, 640, 320, 256, 320, 160, 128, 100, 80]


def test_gefl_cnn_parameter_counts_by_hand():
  count = lambda name, c: sum(a.size for a in jax.tree.leaves(jax.eval_shape(
      lambda: build_model(name, 10, 16).init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, c))))['params']['extractor']))
  # Table XXI CNN-1 (1 channel): conv(1->3) 9*1*3+3 + bn(3) 6 + conv(3->16) 9*3*16+16 = 30 + 6 + 448.
  assert count('gefl_mnist_cnn1', 1) == 484
  # Table XXIII CNN-1: conv(3->3) 84 + bn 6 + conv(3->10) 280 + bn 20 + conv(10->16) 1456.
  assert count('gefl_cifar10_cnn1', 3) == 1846
  # Table XXII CNN-4 (BN after every conv): 30 + 6 + conv(3->10) 280 + bn 20 + conv(10->20) 1820 + bn 40.
  assert count('gefl_fmnist_cnn4', 1) == 2196


def test_model_family_assignment_and_errors():
  assert assign_models(['a', 'b', 'c'][:2] and ['cnn4', 'mlp'], 5) == ['cnn4', 'mlp', 'cnn4', 'mlp', 'cnn4']
  with pytest.raises(ConfigError, match="^ModelConfig.names: unknown model 'vgg99'"):
    assign_models(['cnn4', 'vgg99'], 3)
  with pytest.raises(ConfigError, match="^ModelConfig.rm='avg' is unknown"):
    build_model('mlp', 10, 8, rm='avg').init(jax.random.PRNGKey(0), jnp.ones((1, 4, 4, 1)))
  assert {'cnn4', 'resnet18', 'resnet34'} <= set(model_names())


def test_rm_none_puts_the_head_straight_on_the_extractor_features():
  """GeFL's CNNs end in one fc (Table XXI: CNN-1 fc(1024 -> 10), 10,250 parameters; CNN-10 fc(80 -> 10)). A method
  that exchanges representations refuses groups of different widths, with the fix named."""
  import numpy as np
  from fedjax_het.methods import FedProtoConfig, fedavg_grouped, fedproto
  from fedjax_het.data.datasets import make_synthetic
  from fedjax_het.data import make_federated_data
  from fedjax_het.engine import ExecutionConfig, Federation, LocalTraining, ModelConfig
  from fedjax_het.errors import ConfigError
  data = make_federated_data(make_synthetic(40, (32, 32, 1), 10, seed=0), 2, 'iid', 0, protocol='global')
  models = ['gefl_mnist_cnn1', 'gefl_mnist_cnn10']
  fed = Federation(fedavg_grouped(10), data, ModelConfig(models, feature_dim=128, rm='none'),
                   LocalTraining(0.1, 8, 1), ExecutionConfig(strategy='sequential', conv='xla'), rounds=1)
  heads = [jax.eval_shape(lambda: g.model.init(jax.random.PRNGKey(0), g.spec.sample_input()))['params']['head']
           for g in fed.groups]
  assert [g.spec.feature_dim for g in fed.groups] == [1024, 80]
  assert [sum(int(np.prod(a.shape)) for a in jax.tree.leaves(h)) for h in heads] == [10250, 810]
  assert 'rm_fc' not in jax.eval_shape(lambda: fed.groups[0].model.init(
      jax.random.PRNGKey(0), fed.groups[0].spec.sample_input()))['params']
  with pytest.raises(ConfigError, match="ModelConfig.rm='none'"):
    Federation(fedproto(FedProtoConfig(), 10), data, ModelConfig(models, rm='none'), LocalTraining(0.1, 8, 1),
               ExecutionConfig(strategy='sequential', conv='xla'), rounds=1)


def test_bfloat16_precision_computes_in_bfloat16_from_float32_parameters():
  """Parameters, gradients and BatchNorm statistics stay float32; the computation runs in bfloat16 (its outputs
  within bfloat16's rounding of float32's, returned as float32)."""
  import jax.numpy as jnp
  from fedjax_het.models import build_model
  from fedjax_het.models.forward import forward
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 32, 32, 3))
  f32, bf16 = (build_model('resnet6', 10, 32, precision=p) for p in ('float32', 'bfloat16'))
  variables = jax.jit(f32.init)(jax.random.PRNGKey(1), x)
  params, state = variables.pop('params'), dict(variables)
  loss = lambda model: lambda p: forward(model, p, state, x, True)[0].sum()
  # Jitted, as the engine runs it (and one program each instead of an eager op per layer).
  (out32, rep32, new32), (out16, rep16, new16) = (jax.jit(lambda p, m=m: forward(m, p, state, x, True))(params)
                                                  for m in (f32, bf16))
  assert out16.dtype == rep16.dtype == jnp.float32
  assert jax.tree.map(lambda a: a.dtype, new16) == jax.tree.map(lambda a: a.dtype, new32)  # float32 statistics
  assert float(jnp.abs(out16 - out32).max()) > 0  # it did compute in bfloat16
  np.testing.assert_allclose(out16, out32, rtol=0.1, atol=0.1)
  grads = jax.jit(jax.grad(loss(bf16)))(params)
  assert {a.dtype for a in jax.tree.leaves(grads)} == {jnp.dtype('float32')}
  hlo = jax.jit(loss(bf16)).lower(params).as_text()
  assert 'bf16' in hlo and 'bf16' not in jax.jit(loss(f32)).lower(params).as_text()


def test_an_unknown_precision_names_the_setting():
  from fedjax_het.engine.groups import ModelConfig
  with pytest.raises(ConfigError, match="^ModelConfig.precision='fp8' is unknown"):
    ModelConfig(('cnn4',), precision='fp8')


# CIFAR-style ResNets, by hand from the blocks. resnet18_cifar: torchvision's extractor 11,176,512 with the 3x3 stem
# (3*64*9 = 1,728) in place of the 7x7 one (9,408): 11,168,832 (kuangliu's CIFAR ResNet-18, 11,173,962, minus its
# Linear(512, 10)). preact_resnet18 from it: no stem BN (-128), bare 1x1 shortcuts (-2 * (128 + 256 + 512)), the
# trunk's closing BN (+1,024), and each stage's first block normalising its narrower input (-(128 + 256 + 512)).
# resnet20_cifar: stem 432 + BN 32; a 16-wide block 2 * 2,304 + 64 = 4,672; the 32-wide stage's first block
# 4,608 + 9,216 + 128 + projection 512 + 64 = 14,528, the others 18,560; the 64-wide stage's first 18,432 + 36,864 +
# 256 + 2,048 + 128 = 57,728, the others 73,984: 464 + 3 * 4,672 + 14,528 + 2 * 18,560 + 57,728 + 2 * 73,984.
# resnet56_cifar: the same with 9 blocks a stage.
CIFAR_EXTRACTORS = {'resnet18_cifar': (11168832, (4, 4, 512)), 'preact_resnet18': (11167040, (4, 4, 512)),
                    'resnet20_cifar': (271824, (8, 8, 64)), 'resnet56_cifar': (855120, (8, 8, 64)),
                    'preact_resnet18@0.5': (None, (4, 4, 256))}


@pytest.mark.parametrize('name', sorted(CIFAR_EXTRACTORS))
def test_cifar_resnets_keep_the_resolution_into_the_first_stage_and_count_their_parameters(name):
  count, shape = CIFAR_EXTRACTORS[name]
  extractor = build_model(name, 10, 512).extractor
  variables = jax.eval_shape(lambda: extractor.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3))))
  out = jax.eval_shape(lambda v: extractor.apply(v, jnp.zeros((1, 32, 32, 3))), variables)
  assert out.shape == (1,) + shape
  if count is not None:
    assert sum(a.size for a in jax.tree.leaves(variables['params'])) == count


def test_batchnorm_computes_flaxs_arithmetic_bit_for_bit():
  """The written-out BatchNorm against flax.linen.BatchNorm (momentum 0.9, eps 1e-5): the same variables, outputs
  in train and eval mode, masked statistics, gradients and running mean, in float32 and bfloat16 (the running
  variance differs by design: torch's unbiased update, the test below)."""
  import flax.linen as nn
  from fedjax_het.models.norm import TorchBatchNorm

  def net(norm):
    class Net(nn.Module):
      @nn.compact
      def __call__(self, x, train, mask=None):
        h = norm(use_running_average=not train)(nn.Dense(5)(x), mask=mask)
        return norm(use_running_average=not train)(nn.relu(h), mask=mask)
    return Net()
  ours, flaxs = net(TorchBatchNorm), net(lambda **kw: nn.BatchNorm(momentum=0.9, epsilon=1e-5, **kw))
  x = 2 * jax.random.normal(jax.random.PRNGKey(1), (6, 3, 3, 4)) + 1
  mask = jnp.broadcast_to((jnp.arange(6) < 4)[:, None, None, None], (6, 3, 3, 5))
  variables = ours.init(jax.random.PRNGKey(0), x, True)
  assert jax.tree.map(jnp.shape, variables) == jax.tree.map(jnp.shape, flaxs.init(jax.random.PRNGKey(0), x, True))
  for dtype in (jnp.float32, jnp.bfloat16):
    v, xd = jax.tree.map(lambda a: a.astype(dtype), variables), x.astype(dtype)
    results = []
    for model in (ours, flaxs):
      train = lambda v, x, mask=None: model.apply(v, x, True, mask, mutable=['batch_stats'])
      loss = lambda v, x: jnp.sum(jnp.sin(train(v, x)[0].astype(jnp.float32)))
      results.append((jax.jit(lambda v, x: model.apply(v, x, False))(v, xd), jax.jit(train)(v, xd)[0],
                      jax.jit(train)(v, xd, mask)[0], jax.jit(train)(v, xd)[1]['batch_stats']['BatchNorm_0']['mean'],
                      jax.jit(jax.grad(loss))(v, xd)))
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
      assert a.dtype == b.dtype
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_batchnorm_arithmetic_is_traced_once_per_shape_and_setting(monkeypatch):
  """Layers of one shape share one trace of the arithmetic (`norm._batch_norm`, jitted and inlined): four train-mode
  layers trace it once (a layer traced in place would trace it four times)."""
  import flax.linen as nn
  from jax import lax
  from fedjax_het.models.norm import BatchNorm

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(4):
        x = BatchNorm(use_running_average=False)(x)
      return x
  x = jnp.ones((2, 3, 3, 13))  # a shape no other test normalises: nothing traced yet
  variables = Net().init(jax.random.PRNGKey(0), x)
  traced = []
  rsqrt = lax.rsqrt
  monkeypatch.setattr(lax, 'rsqrt', lambda a: traced.append(a.shape) or rsqrt(a))
  jax.jit(lambda v, x: Net().apply(v, x, mutable=['batch_stats'])).trace(variables, x)
  assert traced == [(1, 1, 1, 13)]


def test_batchnorm_running_variance_is_torchs_unbiased_one():
  """A train step normalises with the biased batch variance and moves the running variance towards the unbiased one
  over rows x positions (torch.nn.BatchNorm2d): values 1, 3, 5, 7 (two rows of two positions; a third, masked
  row left out) have mean 4, biased variance 5, unbiased 20 / 3; running variance 0.9 * 1 + 0.1 * 20 / 3."""
  from fedjax_het.models.norm import TorchBatchNorm, batch_rows
  x = jnp.array([[[1.0], [3.0]], [[5.0], [7.0]], [[100.0], [-100.0]]])[:, None]  # [3, 1, 2, 1]
  norm = TorchBatchNorm(use_running_average=False)
  variables = norm.init(jax.random.PRNGKey(0), x)
  with batch_rows(jnp.array([True, True, False])):
    y, updated = norm.apply(variables, x, mutable=['batch_stats'])
  np.testing.assert_allclose(updated['batch_stats']['mean'], [0.4], rtol=1e-6)
  np.testing.assert_allclose(updated['batch_stats']['var'], [0.9 + 0.1 * 20 / 3], rtol=1e-6)
  np.testing.assert_allclose(y[0, 0, :, 0], (jnp.array([1.0, 3.0]) - 4) / jnp.sqrt(5 + 1e-5), rtol=1e-5)


def test_init_shapes_are_traced_once_per_equal_module_and_returned_in_fresh_containers():
  from fedjax_het.models.shapes import init_shapes, variable_shapes
  traced = []
  listener = lambda event, duration, **kw: traced.append(event) if event.endswith('jaxpr_trace_duration') else None
  model = build_model('small_cnn', num_classes=3, feature_dim=12)
  first = variable_shapes(model, (8, 8, 1))
  expected = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)), train=False))
  assert jax.tree.map(lambda s: (s.shape, s.dtype), first) == jax.tree.map(lambda s: (s.shape, s.dtype), expected)
  first.pop('params')  # a caller editing its copy
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    again = variable_shapes(build_model('small_cnn', num_classes=3, feature_dim=12), (8, 8, 1))  # an equal module
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert traced == [] and 'params' in again
  (logits, rep), _ = init_shapes(model, (8, 8, 1), train=False)
  assert logits.shape == (1, 3) and rep.shape == (1, 12)


def test_conv_and_dense_read_their_parameters_without_tracing_their_initialisers():
  """`models.layers`: applied, the layers do not call their initialisers (flax's do, to check shapes); initialised,
  they draw what flax's draw, under flax's names, and compute what flax's compute."""
  import flax.linen as nn
  from fedjax_het.models.layers import Conv, Dense
  calls = []

  def counted(name, init):
    return lambda *args: calls.append(name) or init(*args)

  def net(conv, dense):
    class Net(nn.Module):
      @nn.compact
      def __call__(self, x):
        x = conv(4, (3, 3), kernel_init=counted('conv', nn.initializers.lecun_normal()))(x)
        return dense(3, kernel_init=counted('dense', nn.initializers.lecun_normal()),
                     bias_init=counted('bias', nn.initializers.normal()))(x.reshape(x.shape[0], -1))
    return Net()

  x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 5, 2))
  ours, flax_own = net(Conv, Dense), net(nn.Conv, nn.Dense)
  variables = ours.init(jax.random.PRNGKey(0), x)
  assert sorted(calls) == ['bias', 'conv', 'dense']  # initialising draws each once
  reference = flax_own.init(jax.random.PRNGKey(0), x)
  assert jax.tree.structure(variables) == jax.tree.structure(reference)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(reference)))
  calls.clear()
  y = ours.apply(variables, x)
  assert calls == []
  np.testing.assert_array_equal(y, flax_own.apply(variables, x))
  assert sorted(calls) == ['bias', 'conv', 'dense']  # flax's layers trace each initialiser at every application


def test_a_value_cache_serves_equal_hashable_arguments_once_and_computes_unhashable_ones_each_time():
  from fedjax_het.models.shapes import cached_when_hashable
  calls = []

  @cached_when_hashable(maxsize=4)
  def length(x):
    calls.append(x)
    return len(x)
  assert [length((1, 2)), length((1, 2)), length([1, 2, 3]), length([1, 2, 3])] == [2, 2, 3, 3]
  assert calls == [(1, 2), [1, 2, 3], [1, 2, 3]]


# ---------------------------------------------------------------- runs of identical blocks scanned (models/repeat.py)
def _train_and_eval(model, variables, x, scan: bool):
  """A train-mode gradient and statistics update, and an eval pass, of `model` with `scan` set."""
  model = model.clone(scan=scan)
  rest = {k: v for k, v in variables.items() if k != 'params'}

  def loss(p):
    out, updated = model.apply({'params': p, **rest}, x, train=True, mutable=list(rest))
    return jnp.sum(out ** 2), updated

  return jax.jit(lambda v: (jax.value_and_grad(loss, has_aux=True)(v['params']), model.apply(v, x)))(variables)


def _scanned_model(kind: str):
  from fedjax_het.models.resnet import Bottleneck, ResNet
  from fedjax_het.models.vit import VisionTransformer
  if kind == 'resnet':  # a stage of three bottlenecks: the first (a projection) and a run of two
    return ResNet((3,), base_width=4, block=Bottleneck, stem='cifar')
  return VisionTransformer(4, hidden=8, depth=3, num_heads=2, mlp_dim=16)


@pytest.mark.parametrize('kind', ['resnet', pytest.param('vit', marks=pytest.mark.slow)])  # ViT: 7 s, `-m slow`
def test_scanned_blocks_keep_the_unrolled_variables_and_numbers(kind):
  model = _scanned_model(kind)
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 8, 8, 3))
  init = lambda m: jax.jit(lambda: m.init(jax.random.PRNGKey(0), x))()
  variables, scanned_init = init(model), init(model.clone(scan=True))
  assert jax.tree.structure(scanned_init) == jax.tree.structure(variables)
  jax.tree.map(np.testing.assert_array_equal, scanned_init, variables)
  # a run of identical blocks: one scan where asked, none otherwise
  assert 'scan' in str(jax.make_jaxpr(lambda v: model.clone(scan=True).apply(v, x))(variables))
  assert 'scan' not in str(jax.make_jaxpr(lambda v: model.apply(v, x))(variables))
  (((value, updated), grads), evaluated), scanned = (_train_and_eval(model, variables, x, scan)
                                                     for scan in (False, True))
  assert float(value) > 0
  # the same operations; XLA fuses them differently inside a loop, so float32 rounding may differ (a block applied
  # with another's variables, or skipped, differs by the leaf's own magnitude)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max())),
               scanned, (((value, updated), grads), evaluated))
  if 'batch_stats' in variables:  # every block's statistics moved, under its own name
    assert all(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(updated['batch_stats']),
                                                        jax.tree.leaves(variables['batch_stats'])))


def test_scan_blocks_reaches_the_extractors_that_have_runs_of_blocks():
  assert build_model('resnet34', 10, 64, scan_blocks=True).extractor.scan
  assert build_model('vit_b32', 10, 64, scan_blocks=True).extractor.scan
  assert not build_model('resnet34', 10, 64).extractor.scan
  build_model('cnn4', 10, 64, scan_blocks=True)  # no runs of blocks: built as it is
