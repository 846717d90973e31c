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
from torch_reference import TorchCNN4, TorchFedRE, client_tensors, load_flax_params  # noqa: E402

from fedjax_het.core import Batch, ClientState  # noqa: E402
from fedjax_het.data import make_federated_data, make_synthetic  # noqa: E402
from fedjax_het.engine import ExecutionConfig, Federation, LocalTraining, batch_schedule  # noqa: E402
from fedjax_het.methods import FedREConfig, fedre  # noqa: E402
from fedjax_het.methods.shared.base import sgd_program  # noqa: E402
from fedjax_het.methods.shared.common import cross_entropy_loss  # noqa: E402
from fedjax_het.models import build_model  # noqa: E402
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


@pytest.mark.parametrize('disk_io', [False, True])
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
