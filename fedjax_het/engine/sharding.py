"""The 'clients' device mesh: where a group's stacked client axis lives when it is sharded over devices.

Single host: `client_mesh()` spans the local devices. Multi-host (one process per host, e.g. a TPU pod slice or a
multi-node GPU job): call `jax.distributed.initialize()` first (`--distributed` in experiments/), then every
process builds the same `Federation` from the same seed; `client_mesh()` spans all processes' devices, each
process places and computes only its addressable shard, and host reads gather across processes.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fedjax_het.errors import ConfigError

CLIENTS_AXIS = 'clients'


def client_mesh(num_devices: int = 0) -> Mesh:
  """A 1-D mesh with axis 'clients' over the first `num_devices` devices (0: all devices of all processes)."""
  devices = jax.devices()
  if num_devices < 0 or num_devices > len(devices):
    raise ConfigError(f'client_mesh.num_devices={num_devices}: this run sees {len(devices)} '
                      f'{jax.default_backend()} device(s). Fix: client_mesh.num_devices between 1 and {len(devices)}, '
                      f'or 0 for all.')
  return Mesh(np.asarray(devices[:num_devices or len(devices)]), (CLIENTS_AXIS,))


def place_clients(tree: Any, mesh: Optional[Mesh]) -> Any:
  """Puts host or device arrays with a leading client axis on device: sharded over `mesh`'s 'clients' axis (its
  length must divide evenly), or on the default device when `mesh` is None."""
  if mesh is None:
    return jax.device_put(tree)
  sharding = NamedSharding(mesh, PartitionSpec(CLIENTS_AXIS))

  def put(a):
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
      return jax.device_put(a, sharding)
    host = np.asarray(a)  # identical on every process: each one keeps only its addressable shard
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
  return jax.tree.map(put, tree)


def place_replicated(tree: Any, mesh: Optional[Mesh]) -> Any:
  """Puts a pytree whole on every device of `mesh` (as a round's jitted server step leaves the server state, so
  the first round compiles the programs every later round runs); unchanged when `mesh` is None."""
  if mesh is None:
    return tree
  sharding = NamedSharding(mesh, PartitionSpec())

  def put(a):
    host = to_host(a)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
  return jax.tree.map(put, tree)


def to_device(x: Any, dtype: Any = None) -> jax.Array:
  """A host value (NumPy array or Python scalar, in `dtype` if given) as an uncommitted array on the default device,
  compiling nothing: `jnp.asarray` of a NumPy array compiles a copy program per shape and dtype, `jnp.zeros` and
  `jnp.full` two, and a round that builds its inputs eagerly paid one compilation each. Outside `jit` only."""
  return jax.device_put(np.asarray(x, dtype))


def device_zeros(shape: Any, dtype: Any = np.float32) -> jax.Array:
  """`jnp.zeros(shape, dtype)` without compiling anything (`to_device`)."""
  return to_device(np.zeros(shape, dtype))


def to_host(x: Any) -> np.ndarray:
  """A NumPy copy of a device array, gathered from every process when it spans several."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)
