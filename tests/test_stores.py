"""Flat, compact client rows (engine/stores.py): exact uint8 palettes, padded views equal to the padded arrays,
and rows past a client's count read as zeros."""

import jax.numpy as jnp
import numpy as np

from fedjax_het.data.datasets import normalize_uint8
from fedjax_het.data.federated import flat_clients, stack_clients
from fedjax_het.engine import stores
from fedjax_het.engine.stores import RowStore, decode, gather_rows, palette_codes


def byte_images(n, seed=0, channels=3):
  return normalize_uint8(np.random.RandomState(seed).randint(0, 256, (n, 4, 4, channels)).astype(np.uint8))


def test_byte_images_are_stored_as_codes_and_decoded_bit_for_bit():
  x = byte_images(500)
  codes, palette = palette_codes(x)
  assert codes.dtype == np.uint8 and palette.shape == (256, 3)
  assert np.array_equal(decode(codes, palette).view(np.uint32), x.view(np.uint32))
  assert np.array_equal(np.asarray(decode(jnp.asarray(codes), jnp.asarray(palette))), x)  # on the device too


def test_values_the_sample_misses_join_the_palette(monkeypatch):
  monkeypatch.setattr(stores, '_SAMPLE', 8)  # a sample of every 1,000th pixel: most of the 256 levels are missed
  x = byte_images(2000, channels=1)
  codes, palette = palette_codes(x)
  assert palette is not None and np.array_equal(decode(codes, palette), x)


def test_images_of_more_than_256_values_or_negative_zero_stay_float32():
  x = np.random.RandomState(0).normal(size=(50, 4, 4, 2)).astype(np.float32)
  assert palette_codes(x)[1] is None and palette_codes(x)[0] is x
  signed_zeros = np.zeros((4, 2, 2, 1), np.float32)
  signed_zeros[1] = -0.0
  assert palette_codes(signed_zeros)[1] is None


def test_a_store_pads_like_the_padded_arrays_and_reads_zeros_past_a_client():
  x, y = byte_images(30), np.arange(30) % 7
  lists = [np.array([3, 1, 4]), np.array([], int), np.array([29, 0, 5, 9, 2])]
  store = RowStore(flat_clients(x, y, lists))
  assert store.rows.x.dtype == np.uint8 and store.n.tolist() == [3, 0, 5] and store.n_max == 5
  padded, expected = store.padded(4), stack_clients(x, y, lists + [lists[-1]])  # a phantom copy of the last
  for a, b in zip(padded, expected):
    np.testing.assert_array_equal(a, b)
  device = store.device()
  xs, ys = gather_rows(device, store.offset[2], store.n[2], jnp.arange(7))
  np.testing.assert_array_equal(np.asarray(xs[:5]), x[lists[2]])
  np.testing.assert_array_equal(np.asarray(ys[:5]), y[lists[2]])
  assert not np.asarray(xs[5:]).any() and not np.asarray(ys[5:]).any()  # past its 5 rows: zeros, as padding
