"""Baseline details that follow HtFLlib's code: where statistics are gathered, which rate the server uses."""

import jax
import jax.numpy as jnp
import numpy as np

from conftest import tree_allclose
from fedjax_het.methods import FDConfig, FedKDConfig, FedProtoConfig, FedTGPConfig, fd, fedproto, fedtgp
from fedjax_het.methods.fedproto import PrototypeUpload
from fedjax_het.methods.shared.common import class_prototypes
from types import SimpleNamespace

from fedjax_het.core import Uploads, parts, server_step
from fedjax_het.engine import ExecutionConfig, Federation, LocalTraining, ModelConfig, run_client
from fedjax_het.models.forward import forward


def _one_client_round(alg, data, training, strategy='vmap'):
  fed = Federation(alg, data, ModelConfig(['mlp'], feature_dim=16), training,
                   ExecutionConfig(strategy=strategy, conv='xla', eval_batch_size=16))
  g = fed.groups[0]
  state = fed.init()
  take = lambda t: jax.tree.map(lambda a: a[0], t)
  client, data0 = take(state.groups[0]), take(g.train)
  update = lambda c, d: run_client(fed.programs[0][0], g.model, c, d, fed.broadcast(state.server, 0, 0),
                                   jax.random.PRNGKey(3), 16)
  _, upload, _ = jax.jit(update)(client, data0)
  return g.model, client, data0, upload


def test_fedproto_and_fd_gather_statistics_over_the_training_passes(tiny_data):
  """With a vanishing learning rate the model stands still, so the training-pass class means equal the class
  means of its outputs over exactly the rows the stored-order loader yields (B*floor(n/B)), over both epochs."""
  training = LocalTraining(learning_rate=1e-30, batch_size=8, epochs=2)
  for alg, which in ((fedproto(FedProtoConfig(), 4), 'protos'), (fd(FDConfig(), 4), 'logits')):
    model, client, data, upload = _one_client_round(alg, tiny_data, training)
    logits, reps, _ = forward(model, client.params, client.model_state, data.x, False)
    used = jnp.arange(data.y.shape[0]) < int(data.n) // 8 * 8
    means, counts = class_prototypes(reps if which == 'protos' else logits, data.y, used, 4)
    np.testing.assert_allclose(parts(upload)[which], means, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(parts(upload)['counts'], 2 * counts)  # every row once per epoch


def test_fedproto_upload_equals_in_both_strategies(tiny_data):
  training = LocalTraining(learning_rate=0.05, batch_size=8, epochs=1)
  alg = fedproto(FedProtoConfig(), 4)
  ups = []
  for strategy in ('vmap', 'sequential'):
    fed = Federation(alg, tiny_data, ModelConfig(['mlp'], feature_dim=16), training,
                     ExecutionConfig(strategy=strategy, conv='xla', eval_batch_size=16))
    state, _ = fed.round(fed.init())
    ups.append(state.server)
  tree_allclose(ups[0], ups[1], rtol=1e-5, atol=1e-6)


def test_fedtgp_server_trains_at_the_local_learning_rate_by_default():
  k, c, d = 3, 4, 6
  uploads = (Uploads(PrototypeUpload(jax.random.normal(jax.random.PRNGKey(0), (k, c, d)),
                                     jnp.array([[2., 0., 1., 3.], [1., 1., 0., 0.], [0., 4., 4., 1.]])),
                     jnp.array([True, True, True]), jnp.ones(k)),)
  at = lambda rate: SimpleNamespace(feature_dim=d, training=LocalTraining(rate, 4, 1))
  runs = ((FedTGPConfig(server_epochs=3), at(0.3)),  # the local rate: 0.3
          (FedTGPConfig(server_epochs=3, server_learning_rate=0.3), at(0.01)),
          (FedTGPConfig(server_epochs=3, server_learning_rate=0.01), at(0.3)))
  results = []
  for cfg, spec in runs:
    alg = fedtgp(cfg, c)
    server = alg.init_server(jax.random.PRNGKey(1), spec, None)
    results.append(server_step(alg.phases[0], spec)(server, uploads, jax.random.PRNGKey(2))[0].prototypes.protos)
  np.testing.assert_array_equal(results[0], results[1])
  assert not np.allclose(results[0], results[2])


def test_fedkd_mentee_rate_defaults_to_htfllib_script():
  assert FedKDConfig().mentee_learning_rate == 0.01
