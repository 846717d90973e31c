"""Where a vmapped call's client states and rows live: on the device whole (`ResidentClients`), or on the host with
each chunk's copied to the device for its call and back (`StreamedClients`, `--stream_clients`)."""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from fedjax_het.engine.groups import Group
from fedjax_het.engine.sharding import to_device, to_host
from fedjax_het.engine.stores import DeviceRows, RowStore


def host_states(stacked: Any, copy: bool = True) -> Any:
  """Stacked client states on the host: a writable copy (a round updates its copy, never the state it was given),
  or with copy=False the arrays themselves where they are there already (for reading)."""
  return jax.tree.map(lambda a: np.array(to_host(a)) if copy else np.asarray(to_host(a)), stacked)


class ResidentClients:
  """A group's client states and rows on the device: a chunk's call receives them whole and picks its clients
  (`idx`); `blocks[i]` is the block of `rows` client i reads (default: its own)."""

  def __init__(self, g: Group, rows: RowStore, stacked: Any, placement: Callable, blocks=None):
    self.g, self.rows, self.stacked, self.placement = g, rows, stacked, placement
    self.blocks = np.arange(len(rows.n)) if blocks is None else np.asarray(blocks)

  def inputs(self, idx: np.ndarray, width: int) -> tuple:
    """(states, store, offsets, counts) of a call over slots `idx` (past the group: empty)."""
    block = self.blocks[np.minimum(idx, self.g.size - 1)]
    real = idx < self.g.size
    return (self.stacked, self.rows.device(self.placement),
            to_device(np.where(real, self.rows.offset[block], 0), np.int32),
            to_device(np.where(real, self.rows.n[block], 0), np.int32))

  def prefetch(self, idx: np.ndarray, width: int) -> tuple:
    """`inputs` made ahead of the call, the states left out (the call before it returns them)."""
    return (None,) + self.inputs(idx, width)[1:]

  def written(self, idx, states) -> None:
    """Takes the states a call returned (the whole stack)."""
    self.stacked = states

  def states(self) -> Any:
    return self.stacked


class StreamedClients(ResidentClients):
  """A group's client states and rows on the host: a chunk's call receives only its clients' states and rows,
  copied to the device (slot j's rows at j * n_max of a [width * n_max] block), and its states are copied back.
  Rows shared by every client (`shared_rows`, a global test set) stay on the device."""

  def __init__(self, g: Group, rows: RowStore, stacked: Any, placement: Callable, blocks=None,
               shared_rows: bool = False):
    super().__init__(g, rows, stacked, placement, blocks)
    self.shared_rows = shared_rows

  def inputs(self, idx: np.ndarray, width: int) -> tuple:
    pick = np.minimum(idx, self.g.stacked_size - 1)
    clients = jax.device_put(jax.tree.map(lambda a: a[pick], self.stacked))
    if self.shared_rows:
      return (clients,) + super().inputs(idx, width)[1:]
    span, host = self.rows.n_max, self.rows.rows
    x = np.zeros((width * span,) + host.x.shape[1:], host.x.dtype)
    y = np.zeros(width * span, np.int32)
    counts = np.zeros(width, np.int32)
    for j, i in enumerate(idx):
      if i < self.g.size:
        b = self.blocks[i]
        lo, k = int(self.rows.offset[b]), int(self.rows.n[b])
        x[j * span:j * span + k], y[j * span:j * span + k], counts[j] = host.x[lo:lo + k], host.y[lo:lo + k], k
    store = jax.device_put(DeviceRows(x, y, self.rows.palette))
    return clients, store, to_device(np.arange(width) * span, np.int32), to_device(counts)

  prefetch = inputs

  def written(self, idx, states) -> None:
    """Copies a call's updated states back into the host stack (nothing for a warm-up call, `idx` None)."""
    if idx is None:
      return
    real = idx < self.g.size
    new = jax.device_get(states)
    for host, values in zip(jax.tree.leaves(self.stacked), jax.tree.leaves(new)):
      host[idx[real]] = values[real]
