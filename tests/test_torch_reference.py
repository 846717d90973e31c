"""The PyTorch reference loop (benchmarks/torch_reference.py) does the same work as fedjax_het's FedRE round."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip('torch', reason='PyTorch is not installed: the reference-loop tests need its CPU build '
                            '(pip install torch --index-url https://download.pytorch.org/whl/cpu)')
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'benchmarks'))
from torch_reference import (TORCH_MODELS, TorchCNN4, TorchFedRE, client_tensors, load_flax_classifier,  # noqa: E402
                             load_flax_params, parameter_count, torch_model)

from fedjax_het.core import Batch, ClientState  # noqa: E402
from fedjax_het.data import make_federated_data, make_synthetic  # noqa: E402
from fedjax_het.engine import ExecutionConfig, Federation, LocalTraining, batch_schedule  # noqa: E402
from fedjax_het.methods import FedREConfig, fedre  # noqa: E402
from fedjax_het.methods.shared.base import sgd_program  # noqa: E402
from fedjax_het.methods.shared.common import cross_entropy_loss  # noqa: E402
from fedjax_het.models import build_model  # noqa: E402
from fedjax_het.models.gefl_cnn import gefl_widths  # noqa: E402
from fedjax_het.models.registry import MODEL_FAMILIES  # noqa: E402
from fedjax_het.models.forward import forward  # noqa: E402


def shared_model():
  model = build_model('cnn4', 10, 512)
  params = model.init(jax.random.PRNGKey(3), jnp.zeros((1, 32, 32, 3)))['params']
  return model, params, load_flax_params(TorchCNN4(), params)


def test_shared_initialisation_gives_the_same_function():
  model, params, tmodel = shared_model()
  x = np.random.default_rng(0).normal(size=(5, 32, 32, 3)).astype(np.float32)
  logits, reps, _ = forward(model, params, {}, jnp.asarray(x), False)
  tx = torch.from_numpy(x.transpose(0, 3, 1, 2).copy())
  with torch.no_grad():
    np.testing.assert_allclose(tmodel.represent(tx).numpy(), reps, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(tmodel(tx).numpy(), logits, rtol=1e-4, atol=1e-5)


def test_same_batches_give_the_same_sgd_losses_and_weights():
  model, params, tmodel = shared_model()
  rng = np.random.default_rng(1)
  x = rng.normal(size=(40, 32, 32, 3)).astype(np.float32)
  y = rng.integers(0, 10, 40).astype(np.int32)
  idx, valid = batch_schedule(jax.random.PRNGKey(2), jnp.asarray(40), 40, 8, 1)
  idx = np.asarray(idx)[np.asarray(valid)][:4]
  program = sgd_program(cross_entropy_loss(model), LocalTraining(0.05, 8, 1))
  key = jax.random.PRNGKey(0)
  step = jax.jit(lambda carry, xb, yb: program.stages[0].step(carry, Batch(xb, yb), None, key))
  carry, jax_losses = program.init(ClientState(params, {}, {}, key), None, key), []
  for b in idx:
    carry, loss = step(carry, x[b], y[b])
    jax_losses.append(float(loss))
  ref = TorchFedRE([(torch.zeros(1, 3, 32, 32), torch.zeros(1, dtype=torch.long))], 10, 0.05, 8,
                   init_models=[tmodel])
  torch_losses = ref.local_train(tmodel, torch.from_numpy(x.transpose(0, 3, 1, 2).copy()),
                                 torch.from_numpy(y.astype(np.int64)), batches=list(idx))
  np.testing.assert_allclose(torch_losses, jax_losses, rtol=1e-4)
  assert ref.steps == 4 and ref.samples == 32
  trained = load_flax_params(TorchCNN4(), carry[0].params)
  for a, b in zip(trained.parameters(), tmodel.parameters()):
    np.testing.assert_allclose(b.detach().numpy(), a.detach().numpy(), rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize('disk_io', [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_round_does_the_same_number_of_steps_and_samples(disk_io):
  ds = make_synthetic(num_samples=4 * 60, image_shape=(32, 32, 3), num_classes=10, seed=0)
  data = make_federated_data(ds, 4, 'dirichlet', seed=0, alpha=0.5)
  fed = Federation(fedre(FedREConfig(), 10), data, ['cnn4'], LocalTraining(0.05, 8, 2),
                   ExecutionConfig(strategy='sequential'))
  _, metrics = fed.round(fed.init())
  g = fed.groups[0]
  ref = TorchFedRE(client_tensors(g.train.x, g.train.y, g.train_sizes), 10, 0.05, 8, epochs=2, disk_io=disk_io)
  out = ref.round()
  assert ref.steps == metrics['local_steps'] > 0
  assert ref.samples == metrics['local_samples'] == 8 * ref.steps
  assert np.isfinite(out['train_loss']) and np.isfinite(out['server_loss'])


# ---------------------------------------------------------------- the seed papers' architectures (paper_settings.py)
PAPER_MODELS = MODEL_FAMILIES['fedre-10'] + MODEL_FAMILIES['gefl-cifar10-10']


def flax_parameter_count(name: str) -> int:
  model = build_model(name, 10, 512)
  shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3))))
  return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(shapes['params']))


@pytest.mark.slow  # builds every PyTorch model (8 s); tests/test_models.py checks the counts in the default run
def test_every_paper_model_has_a_pytorch_counterpart_of_the_same_parameter_count():
  assert set(PAPER_MODELS) <= set(TORCH_MODELS)
  counts = {}
  for name in PAPER_MODELS:
    with torch.device('meta'):  # shapes only: ViT-B's 87M parameters are never allocated
      counts[name] = parameter_count(torch_model(name))
    assert counts[name] == flax_parameter_count(name), name
  fedre10 = [counts[n] for n in MODEL_FAMILIES['fedre-10']]
  assert (min(fedre10), max(fedre10)) == (878_538, 87_423_498)  # cnn4 0.88M .. vit_b32 87.42M
  widths = {n: gefl_widths('cifar10', int(n.rsplit('cnn', 1)[1])) for n in MODEL_FAMILIES['gefl-cifar10-10']}
  assert len(set(widths.values())) == 10


def one_step_losses(name: str, double: bool = False, steps: int = 2, rows: int = 16, lr: float = 0.01):
  """fedjax_het's and the PyTorch model's CE losses over `steps` SGD steps on one batch of `rows` rows, from the
  same initial weights (copied across), train mode (BatchNorm on batch statistics); in float64 where `double`.

  In float32 the first loss (the forward pass) agrees to 1e-4, but a step of a deep network on 16 32x32 images is
  ill-conditioned (BatchNorm over 1x1 and 2x2 maps, gradient norms of 160-540): PyTorch's own float32 and float64
  runs of ResNet-152 differ by 5 % in the loss after one step. In float64 both sides agree to 1e-7 (fedjax_het's
  adaptive pooling weights, such as MobileNetV2's 1/3 for 1,280 -> 512 channels, are float32 constants)."""
  model = build_model(name, 10, 512)
  rng = np.random.default_rng(0)
  dtype = np.float64 if double else np.float32
  x = rng.normal(size=(rows, 32, 32, 3)).astype(dtype)
  y = rng.integers(0, 10, rows).astype(np.int32)
  with jax.enable_x64(double):
    variables = jax.tree.map(lambda a: a.astype(dtype), model.init(jax.random.PRNGKey(1), jnp.asarray(x)))
    params, model_state = variables['params'], {k: v for k, v in variables.items() if k != 'params'}
    program = sgd_program(cross_entropy_loss(model), LocalTraining(lr, rows, 1))
    key = jax.random.PRNGKey(0)
    step = jax.jit(lambda carry: program.stages[0].step(carry, Batch(jnp.asarray(x), jnp.asarray(y)), None, key))
    carry, jax_losses = program.init(ClientState(params, model_state, {}, key), None, key), []
    for _ in range(steps):
      carry, loss = step(carry)
      jax_losses.append(float(loss))
  tmodel = load_flax_classifier(name, torch_model(name), jax.device_get(params), jax.device_get(model_state))
  ref = TorchFedRE([(torch.zeros(1, 3, 32, 32), torch.zeros(1, dtype=torch.long))], 10, lr, rows,
                   init_models=[tmodel.to(torch.float64 if double else torch.float32)])
  torch_losses = ref.local_train(tmodel, torch.from_numpy(x.transpose(0, 3, 1, 2).copy()),
                                 torch.from_numpy(y.astype(np.int64)), batches=[np.arange(rows)] * steps)
  return jax_losses, torch_losses


FAST = ()  # all in the slow set (GeFL's CNN-8 7 s, ResNet-18 30-100 s, ResNet-152 and the ViTs minutes); the parameter
# counts of every paper model are checked in the default run


@pytest.mark.parametrize('name', [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in PAPER_MODELS])
def test_an_sgd_step_of_a_paper_model_gives_the_same_losses(name):
  """Two SGD steps from the same weights: the loss before the first step (the forward pass and the weight mapping)
  in float32, and the loss after it (so the gradient too) in float64 (see one_step_losses)."""
  jax_losses, torch_losses = one_step_losses(name)
  np.testing.assert_allclose(torch_losses[0], jax_losses[0], rtol=1e-4)
  jax_losses, torch_losses = one_step_losses(name, double=True)
  assert abs(jax_losses[0] - jax_losses[1]) > 1e-3  # the step moved the loss
  np.testing.assert_allclose(torch_losses, jax_losses, rtol=1e-7)
