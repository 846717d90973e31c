"""Clients' rows as the executors read them: flat (no padding) and compact (one byte per pixel where the images
came from bytes), on the host, copied to the device once, and gathered there batch by batch.

Images normalised from uint8 pixels take at most 256 values per channel, so they are stored as those values'
codes (uint8) with a [256, C] palette, and decoded exactly on the device: a quarter of float32's memory. Images
that do not (resized, or generated as floats) stay float32. A client's rows past its count read as zeros, as
padded rows always did, so a batch or pass that reaches past a client's rows sees what it saw with padding.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_het.data.federated import ClientArrays, FlatRows

PALETTE_SIZE = 256
_SAMPLE = 1 << 20  # values per channel that propose a palette (every value is then checked against it)
_BLOCK = 1 << 16


def palette_codes(x: np.ndarray) -> tuple[np.ndarray, Optional[np.ndarray]]:
  """(codes uint8 [same shape], palette float32 [256, C]) with palette[codes[..., c], c] == x[..., c] bit for bit,
  where x (float32, channels last) takes at most 256 values per channel; else (x, None)."""
  if x.dtype != np.float32 or x.ndim < 2 or x.size == 0:
    return x, None
  channels = x.shape[-1]
  flat = x.reshape(-1, channels)
  sample = flat[::max(1, len(flat) // _SAMPLE)]
  palette = np.zeros((PALETTE_SIZE, channels), np.float32)
  codes = np.empty(flat.shape, np.uint8)
  for c in range(channels):
    values = np.unique(sample[:, c])
    for attempt in range(2):  # the sample's values, then with any the sample missed
      if len(values) > PALETTE_SIZE:
        return x, None
      lookup, missed = _bit_lookup(values), []
      for start in range(0, len(flat), _BLOCK):  # blocks that stay in cache
        bits = np.ascontiguousarray(flat[start:start + _BLOCK, c]).view(np.uint32)
        pos = lookup(bits)
        wrong = values[pos].view(np.uint32) != bits
        if wrong.any():
          missed.append(np.unique(bits[wrong]).view(np.float32))
        codes[start:start + _BLOCK, c] = pos
      if not missed:
        break
      if attempt:  # -0.0 beside 0.0, or NaN: values that do not sort apart
        return x, None
      values = np.union1d(values, np.concatenate(missed))
    palette[:len(values), c] = values
  return codes.reshape(x.shape), palette


def _bit_lookup(values: np.ndarray):
  """bits (uint32 patterns of float32 values) -> the position in `values` of the value with those bits (for bits
  of the values; anything for other bits): a 65,536-entry table indexed by 16 bits of the pattern that tell the
  values apart, else a binary search."""
  patterns = values.view(np.uint32)
  for shift in range(17):
    keys = (patterns >> shift) & 0xFFFF
    if len(np.unique(keys)) == len(keys):
      table = np.zeros(1 << 16, np.uint8)
      table[keys] = np.arange(len(values))
      return lambda bits, shift=shift: table[(bits >> shift) & 0xFFFF]
  return lambda bits: np.minimum(np.searchsorted(values, bits.view(np.float32)), len(values) - 1).astype(np.uint8)


def decode(codes: np.ndarray, palette: Optional[np.ndarray]) -> np.ndarray:
  """The float32 images of `codes` under `palette` (as is without one); numpy or jax arrays alike."""
  if palette is None:
    return codes
  xp = jnp if isinstance(codes, jax.Array) or isinstance(palette, jax.Array) else np
  channels = palette.shape[-1]
  return palette[codes.astype(xp.int32), xp.arange(channels)]


class DeviceRows(NamedTuple):
  """The device copy of a `RowStore`: codes (or float images) x [N, ...], labels y [N], palette [256, C] or
  None."""
  x: jax.Array
  y: jax.Array
  palette: Optional[jax.Array]


class RowStore:
  """One set of clients' rows (a group's training or test rows, or a shared test set), flat and compact on the
  host (`rows`), with their device copy made on first use (`device`) and a padded view for the executors that read
  padded arrays (`padded`)."""

  def __init__(self, rows: FlatRows):
    codes, self.palette = palette_codes(rows.x)
    self.rows = FlatRows(codes, rows.y, rows.offset, rows.n)
    self.n = np.asarray(rows.n)
    self.offset = np.asarray(rows.offset)
    self.n_max = max(int(self.n.max(initial=0)), 1)
    self._device = None

  @property
  def image_shape(self) -> tuple[int, ...]:
    return tuple(self.rows.x.shape[1:])

  def device(self, placement=jax.device_put) -> DeviceRows:
    """The rows on the device (`placement` puts a host pytree there; default: the default device), made once."""
    if self._device is None:
      self._device = placement(DeviceRows(self.rows.x, self.rows.y, self.palette))
    return self._device

  def nbytes(self) -> int:
    """Bytes of the rows as stored (codes or floats, labels)."""
    return int(self.rows.x.nbytes + self.rows.y.nbytes)

  def padded(self, clients: Optional[int] = None) -> ClientArrays:
    """The rows as padded host arrays x [clients, n_max, ...] (float32), y [clients, n_max], n [clients]: client i's
    rows first, then zeros; `clients` >= the store's clients repeats the last one (a mesh's phantom slots)."""
    count = len(self.n)
    clients = clients or count
    x = np.zeros((clients, self.n_max) + self.image_shape, np.float32)
    y = np.zeros((clients, self.n_max), np.int32)
    n = np.zeros(clients, np.int32)
    for slot in range(clients):
      i = min(slot, count - 1)
      lo, k = int(self.offset[i]), int(self.n[i])
      x[slot, :k] = decode(self.rows.x[lo:lo + k], self.palette)
      y[slot, :k] = self.rows.y[lo:lo + k]
      n[slot] = k
    return ClientArrays(x, y, n)


def gather_rows(rows: DeviceRows, offset, n, index) -> tuple[jax.Array, jax.Array]:
  """(x float32 [*index.shape, ...], y [*index.shape]) of rows `index` of the client whose rows start at `offset`
  and number n: decoded images and labels, zeros at indices >= n."""
  real = index < n
  at = jnp.where(real, offset + index, 0)
  x = decode(rows.x[at], rows.palette).astype(jnp.float32)
  x = jnp.where(real.reshape(real.shape + (1,) * (x.ndim - real.ndim)), x, 0.0)
  return x, jnp.where(real, rows.y[at], 0)


def client_view(rows: DeviceRows, offset, n, num_rows: int) -> tuple[jax.Array, jax.Array]:
  """A client's first `num_rows` rows as padded arrays (x [num_rows, ...], y [num_rows]; zeros past its n): what a
  program's `prepare` and `final` read (`core.ClientRows`)."""
  return gather_rows(rows, offset, n, jnp.arange(num_rows))


def nbytes(tree: Any) -> int:
  """Bytes of a pytree's arrays (or their shapes)."""
  return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))
