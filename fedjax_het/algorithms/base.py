"""The algorithm API: a method is a small set of pure functions (optax-style), composed by the engine.

A client update is `client_begin -> local SGD on client_loss -> eval-mode representation pass -> client_upload`;
`fedjax_het.engine.client_update` composes these into ONE pure function of one client, which the engine vmaps
over a group or runs client by client. Uploads are fixed-shape pytrees; the engine stacks them over a leading
client axis (all groups concatenated) and calls `server_update` once per round.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Optional

import jax
import jax.numpy as jnp

from fedjax_het.models.classifier import Companion

if TYPE_CHECKING:  # The engine imports this module; a runtime import back would be circular.
  from fedjax_het.engine.state import ClientState

Broadcast = Any
Upload = Any
ServerState = Any


@dataclasses.dataclass(frozen=True)
class CommSpec:
  """What communication accounting needs to know about a client (num_present_classes: classes in its training
  rows, the number of prototypes it uploads; defaults to num_classes)."""
  num_classes: int
  feature_dim: int
  num_train: int
  num_params: int = 0
  num_present_classes: int = -1
  num_companion_params: int = 0

  def __post_init__(self):
    if self.num_present_classes < 0:
      object.__setattr__(self, 'num_present_classes', self.num_classes)


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """A federated method as pure functions.

  init_server(rng, example_params) -> server state (example_params: client 0's params, e.g. to copy a head).
  broadcast(server) -> what every participating client receives.
  client_begin(client, broadcast) -> client, applied before local training (e.g. set the head to omega).
  client_loss(model, params, model_state, x, y, broadcast, rng) -> (loss, new model_state), or, with
    `train_statistics`, (loss, (new model_state, statistics of this batch as a pytree of sums)).
  client_upload(client, reps, y, n, broadcast, rng, num_train) -> upload pytree (fixed leaf shapes given n_max).
    reps [n_max, d] are eval-mode representations of the client's training rows, of which the first n are the
    rows a statistics pass over its train loader sees (HtFLlib's drop_last loader: B*floor(num_train/B) of them
    under the stored data order) and the rest padding or unused; num_train counts all its training rows (sample
    weights). With `train_statistics`, reps is instead the sum over the local steps of client_loss's statistics.
  server_update(server, uploads, mask, rng) -> (server, metrics); uploads have a leading slot axis, mask marks
    the slots that hold a real participant. Metrics named like the accounting's ('upload_scalars',
    'broadcast_<part>_scalars', ...) replace its figures, for methods whose communication depends on the data.
  eval_heads(client, broadcast) -> {name: head params} scored on each client's test data; the first is the
    method's reported accuracy.
  group_update(stacked params/model_state, participated mask, weights) -> the same, for methods that average
    within an architecture group (None: no group step).
  communication(spec) -> {'upload': {part: scalars}, 'broadcast': {part: scalars}} per participating client.
  companion: a `Companion` model every client trains alongside its own (under params['companion']), or None.
  train_statistics: client_loss also returns per-batch statistics, which the engine sums over the real local
    steps and hands to client_upload in place of a representation pass (FedProto's prototypes and FD's logits are
    gathered in the training passes in HtFLlib).
  eval_client(client, broadcast) -> the client as evaluated (default: as it is; FedMRL scores with the broadcast
    global model in place of its own copy, as HtFLlib does).
  """
  name: str
  init_server: Callable[[jax.Array, Any], ServerState]
  broadcast: Callable[[ServerState], Broadcast]
  client_begin: Callable[[ClientState, Broadcast], ClientState]
  client_loss: Callable[..., tuple[jnp.ndarray, Any]]
  client_upload: Callable[..., Upload]
  server_update: Callable[..., tuple[ServerState, dict]]
  eval_heads: Callable[[ClientState, Broadcast], dict]
  communication: Callable[[CommSpec], dict]
  group_update: Optional[Callable[..., tuple[Any, Any]]] = None
  needs_representations: bool = True
  companion: Optional[Companion] = None
  eval_client: Optional[Callable[[ClientState, Broadcast], ClientState]] = None
  train_statistics: bool = False


def no_server(rng: jax.Array, example_params: Any) -> ServerState:
  """Server state of methods without a server model."""
  return {}


def identity_broadcast(server: ServerState) -> Broadcast:
  """Broadcast the whole server state."""
  return server


def keep_client(client: 'ClientState', broadcast: Broadcast) -> 'ClientState':
  """A client_begin that ignores the broadcast."""
  return client


def no_upload(client, reps, y, n, broadcast, rng, num_train) -> Upload:
  """A client_upload that sends nothing."""
  return {}


def keep_server(server, uploads, mask, rng):
  """A server_update that changes nothing."""
  return server, {}


def local_head(client: 'ClientState', broadcast: Broadcast) -> dict:
  """eval_heads scoring each client with its own head."""
  return {'local_head': client.params['head']}
