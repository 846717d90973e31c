"""The pieces shared by methods whose clients train a small global model beside their own (FML, FedKD, FedMRL):
the model lives under params['companion'] (`HeteroClassifier.companion`), the server keeps and broadcasts one
copy, and every participant starts its round from that copy."""

from __future__ import annotations

from typing import Any

from fedjax_het.algorithms.base import CommSpec
from fedjax_het.engine.state import ClientState
from fedjax_het.errors import ConfigError
from fedjax_het.models.registry import model_names


def check_global_model(arch: str, method: str) -> None:
  """A clear error when --global_model names no registered architecture."""
  if arch not in model_names():
    raise ConfigError(f'{method}: --global_model={arch!r} is not a registered model; choose one of '
                      f'{", ".join(model_names())}.')


def initial_global_model(rng, example_params: Any) -> dict:
  """init_server: the server starts from client 0's initial copy of the global model."""
  return {'companion': example_params['companion']}


def receive_global_model(client: ClientState, broadcast: Any) -> ClientState:
  """client_begin: replace the client's copy of the global model by the broadcast one (BatchNorm statistics,
  if any, stay the client's own, as HtFLlib sends parameters only)."""
  return client._replace(params={**client.params, 'companion': broadcast['companion']})


def global_model_communication(spec: CommSpec) -> dict:
  """Every participant uploads and receives the whole global model."""
  return {'upload': {'global_model': spec.num_companion_params},
          'broadcast': {'global_model': spec.num_companion_params}}
