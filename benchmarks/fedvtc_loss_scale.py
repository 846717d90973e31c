"""Does FedVTC's objective let a client learn to classify? One client, centrally, on all of mnist5k.

  python benchmarks/fedvtc_loss_scale.py --objectives=ce,sum,mean --learning_rates=1e-4,1e-3,1e-2

One small_cnn (--rm=fc, p = 980) trained on the 4,000 mnist5k training digits for --epochs epochs of batch 16, each
batch an f-step then a psi-step (`methods.fedvtc.vtc_steps`), the prototypes c^y set to 0 in the first epoch (the
paper's initial value) and to the class means of the eval-mode z after each epoch (what the server would send).
Objectives: 'ce' (plain SGD on CE, no VTC), 'sum' (the paper's Eq. 3-6), 'mean' (--vtc_loss_reduction=mean).
Prints test accuracy after each epoch and the final norm of z; writes benchmarks/results/fedvtc_loss_scale.json/.csv.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags

from fedjax_het.run.cli import app_run

from harness import RESULTS, write_results
from fedjax_het.core import ClientState
from fedjax_het.data.datasets import load_mnist5k
from fedjax_het.methods.fedvtc import vtc_steps
from fedjax_het.methods.shared.common import cross_entropy, descend
from fedjax_het.models.forward import forward
from fedjax_het.models.registry import build_model
from fedjax_het.models.vtc import VTCDecoder, init_vtc

flags.DEFINE_list('objectives', ['ce', 'sum', 'mean'], "Objectives: 'ce', 'sum', 'mean'.")
flags.DEFINE_list('learning_rates', ['1e-4', '1e-3', '1e-2'], 'Learning rates of f, psi and sigma.')
flags.DEFINE_integer('epochs', 3, 'Epochs over the 4,000 training digits.')
flags.DEFINE_float('vtc_lambda', 0.1, 'lambda of L_dm.')
flags.DEFINE_string('out', RESULTS, 'Output folder.')
FLAGS = flags.FLAGS

P, BATCH = 980, 16


def ce_step(model, lr: float):
  def step(client, x, y, protos, eps):
    def loss(params):
      logits, _, state = forward(model, params, client.model_state, x, True)
      return cross_entropy(logits, y), state
    (value, state), grads = jax.value_and_grad(loss, has_aux=True)(client.params)
    return client._replace(params=descend(optax.sgd(lr), client.params, grads), model_state=state), value
  return step


def train(objective: str, lr: float, epochs: int, lamda: float, ds) -> dict:
  model = build_model('small_cnn', 10, P, 'fc')
  decoder = VTCDecoder((28, 28, 1), P)
  key = jax.random.PRNGKey(0)
  variables = model.init(key, jnp.zeros((1, 28, 28, 1)), False)
  state = {k: v for k, v in variables.items() if k != 'params'}
  client = ClientState(variables['params'], state, {'psi': init_vtc(decoder, key), 'sigma': jnp.ones(P)},
                       key)
  if objective == 'ce':
    f_step, psi_step = ce_step(model, lr), None
  else:
    f_step, psi_step = vtc_steps(model, decoder, 10, lamda, optax.sgd(lr), objective)

  @jax.jit
  def batch_step(client, x, y, protos, eps):
    client, loss = f_step(client, x, y, protos, eps)
    return (psi_step(client, x, y, protos, eps)[0] if psi_step else client), loss

  @jax.jit
  def evaluate(client, x):
    logits, z, _ = forward(model, client.params, client.model_state, x, False)
    return jnp.argmax(logits, -1), z

  x, y, x_test, y_test = map(jnp.asarray, (ds.x, ds.y, ds.x_test, ds.y_test))
  protos, rng, accuracies = jnp.zeros((10, P)), np.random.default_rng(0), []
  start = time.perf_counter()
  for epoch in range(epochs):
    order = rng.permutation(len(ds.y))
    for i in range(0, len(order) - BATCH + 1, BATCH):
      rows = order[i:i + BATCH]
      eps = jax.random.normal(jax.random.fold_in(key, epoch * 100_000 + i), (BATCH, P))
      client, _ = batch_step(client, x[rows], y[rows], protos, eps)
    predicted, _ = evaluate(client, x_test)
    accuracies.append(float(jnp.mean(predicted == y_test)))
    _, z = evaluate(client, x)
    protos = jax.ops.segment_sum(z, y, 10) / jnp.maximum(jnp.bincount(y, length=10), 1)[:, None]
    print(f'{objective} lr={lr:g} epoch {epoch + 1}: test accuracy {100 * accuracies[-1]:.1f} %', flush=True)
  z_norm = float(jnp.mean(jnp.linalg.norm(z, axis=-1)))
  return {'objective': objective, 'learning_rate': lr, 'epochs': epochs,
          'accuracy_per_epoch': ' '.join(f'{a:.4f}' for a in accuracies), 'final_accuracy': accuracies[-1],
          'finite': bool(np.isfinite(z_norm)), 'mean_z_norm': z_norm, 'seconds': time.perf_counter() - start}


def main(_):
  ds = load_mnist5k()
  rows = [train(o, float(lr), FLAGS.epochs, FLAGS.vtc_lambda, ds) for o in FLAGS.objectives
          for lr in FLAGS.learning_rates]
  print('\n| objective | ' + ' | '.join(f'eta = {lr}' for lr in FLAGS.learning_rates) + ' |')
  print('|---|' + '---|' * len(FLAGS.learning_rates))
  for o in FLAGS.objectives:
    cells = [f"{100 * r['final_accuracy']:.1f} % (|z| {r['mean_z_norm']:.2g})" for r in rows if r['objective'] == o]
    print(f'| {o} | ' + ' | '.join(cells) + ' |')
  write_results(FLAGS.out, 'fedvtc_loss_scale', {'epochs': FLAGS.epochs, 'vtc_lambda': FLAGS.vtc_lambda}, rows)


if __name__ == '__main__':
  app_run(main)
