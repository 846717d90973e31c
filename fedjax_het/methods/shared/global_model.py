"""The pieces shared by methods whose clients train a small global model beside their own (FML, FedKD, FedMRL,
pFedAFM, FedType): each client holds its copy in `ClientState.extra` (a `Companion`, or a method's own record
with the same params and state fields: parameters under params['companion'], BatchNorm statistics under
state['companion']), the server keeps and broadcasts one copy (`GlobalModel`, or a method's record with a
global_model field), every participant starts its round from it, and the server averages the participants'
copies, unweighted (HtFLlib)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_het.core import UploadPrivacy
from fedjax_het.errors import ConfigError, setting
from fedjax_het.methods.shared.base import ClientState, GroupSpec
from fedjax_het.models.classifier import HeteroClassifier
from fedjax_het.models.forward import forward
from fedjax_het.models.registry import model_names


class Companion(NamedTuple):
  """A client's extra modules: params and state, each a dict by module name ('companion', the copy of the global
  model; FedKD's 'hidden_map'; FedMRL's 'fusion') of its params and of its non-trainable collections. The
  optimizer of a client that trains them reads params (`base.trainable`)."""
  params: dict
  state: dict


class GlobalModel(NamedTuple):
  """The server state, broadcast and upload of a method that shares a small global model: its params."""
  global_model: dict


def check_global_model(cfg) -> None:
  """A clear error when the method config's `global_model` names no registered architecture."""
  if cfg.global_model not in model_names():
    raise ConfigError(f'{setting(cfg, "global_model")} is not a registered model; choose one of '
                      f'{", ".join(model_names())}.')


def init_global_model(group: GroupSpec, model: HeteroClassifier, key: jax.Array) -> Companion:
  """A client's per-client state holding its copy of the global model, initialised as the run initialises
  clients."""
  variables = group.init_module(model, key, group.sample_input(), name='companion')
  params = variables.pop('params')
  return Companion({'companion': params}, {'companion': variables})


def global_model_forward(model: HeteroClassifier, client: ClientState, x: jnp.ndarray, train: bool = True
                         ) -> tuple[jnp.ndarray, jnp.ndarray, ClientState]:
  """(logits, representation, client with the global model's BatchNorm statistics updated when `train`) of the
  client's copy of the global model."""
  extra = client.extra
  logits, reps, state = forward(model, extra.params['companion'], extra.state['companion'], x, train)
  return logits, reps, client._replace(extra=extra._replace(state={**extra.state, 'companion': state}))


def initial_global_model(key: jax.Array, spec, initial) -> GlobalModel:
  """init_server: the global model every client starts from (the first group's initial copy)."""
  return GlobalModel(initial[0].extra.params['companion'])


def receive_global_model(client: ClientState, broadcast: Any) -> ClientState:
  """The client's copy of the global model replaced by the broadcast one (its BatchNorm statistics stay the
  client's own, as HtFLlib sends parameters only)."""
  extra = client.extra
  return client._replace(extra=extra._replace(params={**extra.params, 'companion': broadcast.global_model}))


def upload_global_model(client: ClientState, rows, broadcast, key) -> GlobalModel:
  """The client's trained copy of the global model."""
  return GlobalModel(client.extra.params['companion'])


def upload_carried_global_model(carry: tuple, rows, broadcast, key) -> tuple[ClientState, dict]:
  """`ClientProgram.final` of a program whose carry is (client, optimizer states...): the client and its trained
  copy of the global model."""
  return carry[0], upload_global_model(carry[0], rows, broadcast, key)


def global_model_step(client: ClientState, loss, optimizer: optax.GradientTransformation, opt_state: Any
                      ) -> tuple[ClientState, Any, jnp.ndarray]:
  """One `optimizer` step of the client's copy of the global model on loss(params) -> (value, its BatchNorm
  statistics after a training-mode pass): (the client with the stepped copy and statistics, the optimizer state,
  the loss value)."""
  extra = client.extra
  params = extra.params['companion']
  (value, state), grads = jax.value_and_grad(loss, has_aux=True)(params)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  extra = extra._replace(params={**extra.params, 'companion': optax.apply_updates(params, updates)},
                         state={**extra.state, 'companion': state})
  return client._replace(extra=extra), opt_state, value


# DP's view of a global-model upload: the delta from the broadcast global model is clipped; the server averages
# the copies of all participants
GLOBAL_MODEL_PRIVACY = UploadPrivacy(reference=lambda b: {'global_model': b.global_model}, aggregate='sum',
                                     hides_participants=True)


def average_global_models(server, uploads, key):
  """The unweighted mean of the participants' global models (kept when nobody participated)."""
  return server._replace(global_model=uploads.mean('global_model', previous=server.global_model)), {}
