"""One client's update as one pure function, and its pieces for host-driven execution."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedjax_het.algorithms.base import Algorithm
from fedjax_het.data.federated import ClientArrays
from fedjax_het.engine.forward import represent_rows
from fedjax_het.engine.state import ClientState
from fedjax_het.engine.training import LocalTraining, train_scan
from fedjax_het.models.classifier import HeteroClassifier


def client_update(algorithm: Algorithm, model: HeteroClassifier, training: LocalTraining, client: ClientState,
                  data: ClientArrays, broadcast: Any, rng: jax.Array, rep_chunk: int = 256,
                  unroll: int | bool = 1) -> tuple[ClientState, Any, dict]:
  """ONE client's round: begin (apply broadcast) -> local SGD (lax.scan) -> representations (or the training-pass
  statistics) -> upload.

  Pure; `data` holds this client's padded rows (x [n_max, ...], y [n_max], n []). Returns (client, upload,
  metrics). The engine vmaps this over a group, or runs the same pieces client by client.
  """
  client = algorithm.client_begin(client, broadcast)
  loss_fn = lambda p, s, x, y, r: algorithm.client_loss(model, p, s, x, y, broadcast, r)
  params, model_state, loss, stats = train_scan(loss_fn, training, client.params, client.model_state, data.x,
                                                data.y, data.n, jax.random.fold_in(rng, 1), unroll,
                                                algorithm.train_statistics)
  client = client._replace(params=params, model_state=model_state)
  if algorithm.train_statistics:
    reps = stats
  elif algorithm.needs_representations:
    _, reps = represent_rows(model, client.params, client.model_state, data.x, rep_chunk)
  else:
    reps = jnp.zeros((data.x.shape[0], 0))
  upload = algorithm.client_upload(client, reps, data.y, training.statistics_rows(data.n), broadcast,
                                   jax.random.fold_in(rng, 2), data.n)
  return client, upload, {'train_loss': loss}
