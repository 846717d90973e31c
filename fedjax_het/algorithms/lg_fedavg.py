"""LG-FedAvg (Liang et al. 2020, as run in HtFLlib): local extractors, a global head.

Each round a participant sets its head to the global head, trains its whole model on CE, and uploads its head; the
server averages the heads weighted by the participants' training-sample counts and broadcasts the average.
"""

from __future__ import annotations

import jax.numpy as jnp

from fedjax_het.algorithms.base import Algorithm, CommSpec, identity_broadcast
from fedjax_het.algorithms.common import cross_entropy_loss, participant_average
from fedjax_het.engine.state import ClientState


def lg_fedavg(num_classes: int) -> Algorithm:
  """LG-FedAvg as an `Algorithm`."""

  def init_server(rng, example_params):
    return {'head': example_params['head']}

  def client_begin(client: ClientState, broadcast) -> ClientState:
    return client._replace(params={**client.params, 'head': broadcast['head']})

  def client_upload(client: ClientState, reps, y, n, broadcast, rng, num_train):
    return {'head': client.params['head'], 'weight': jnp.asarray(num_train, jnp.float32)}

  def server_update(server, uploads, mask, rng):
    """head = sum_k n_k head_k / sum_k n_k over participants (kept when nobody participated)."""
    weights = uploads['weight'] * mask.astype(jnp.float32)
    return {'head': participant_average(uploads['head'], weights, server['head'])}, {}

  def eval_heads(client: ClientState, broadcast):
    return {'global_head': broadcast['head'], 'local_head': client.params['head']}

  def communication(spec: CommSpec):
    head = spec.feature_dim * spec.num_classes + spec.num_classes
    return {'upload': {'head': head}, 'broadcast': {'head': head}}

  return Algorithm('lg_fedavg', init_server, identity_broadcast, client_begin, cross_entropy_loss, client_upload,
                   server_update, eval_heads, communication, needs_representations=False)
