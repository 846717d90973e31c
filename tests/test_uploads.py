"""The round's uploads and their reductions over the participants (fedjax_het.uploads), by hand: two groups, one
with an empty slot, means weighted equally or by training rows, per-class means over the holders, and the
round's uploads reaching a method's server step through `server_step`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_het.core import Phase, server_step
from fedjax_het.uploads import RoundUploads, Uploads

arr = lambda *v: jnp.asarray(v, jnp.float32)


def round_uploads() -> RoundUploads:
  """Group 0: slots holding x = 1 and 3 (10 and 30 rows) and an empty slot holding 100; group 1: x = 8 (60 rows).
  Per class (2 classes): protos and counts."""
  group0 = Uploads({'x': arr(1., 3., 100.), 'protos': arr([1., 10.], [3., 20.], [50., 50.]),
                    'counts': arr([2., 0.], [1., 5.], [9., 9.])},
                   jnp.array([True, True, False]), arr(10., 30., 5.))
  group1 = Uploads({'x': arr(8.), 'protos': arr([8., 40.]), 'counts': arr([4., 1.])}, jnp.array([True]), arr(60.))
  return RoundUploads((group0, group1))


def test_weights_and_holders_leave_empty_slots_out():
  group0 = round_uploads()[0]
  np.testing.assert_array_equal(group0.weights(), [1, 1, 0])
  np.testing.assert_array_equal(group0.weights('rows'), [10, 30, 0])
  np.testing.assert_array_equal(group0.holds(), [[True, False], [True, True], [False, False]])
  rows = group0._replace(values={'rows': jnp.array([[True, False], [True, True], [True, True]])})
  np.testing.assert_array_equal(rows.participant_rows('rows'), [[True, False], [True, True], [False, False]])
  with pytest.raises(ValueError, match="weights\\(by='size'\\): choose one of uniform, rows"):
    group0.weights('size')


def test_means_over_every_groups_participants_by_hand():
  uploads = round_uploads()
  np.testing.assert_allclose(uploads.mean('x'), (1 + 3 + 8) / 3)
  np.testing.assert_allclose(uploads.mean('x', by='rows'), (10 * 1 + 30 * 3 + 60 * 8) / 100)
  np.testing.assert_allclose(uploads.sum('x'), 12.0)
  np.testing.assert_allclose(uploads.mean(lambda v: 2 * v['x']), 8.0)  # a part computed from each group's values
  np.testing.assert_allclose(uploads.group_mean('x', by='rows'), [(10 + 90) / 40, 8.0])
  every = uploads.every('x')
  np.testing.assert_array_equal(every.values, [1, 3, 100, 8])
  np.testing.assert_array_equal(every.mask, [True, True, False, True])


def test_a_round_without_participants_keeps_the_previous_value():
  nobody = RoundUploads(u._replace(mask=jnp.zeros_like(u.mask)) for u in round_uploads())
  np.testing.assert_allclose(nobody.mean('x', previous=jnp.float32(-1.0)), -1.0)
  np.testing.assert_allclose(nobody.group_mean('x', previous=(arr(-1.), arr(-2.))), [[-1.], [-2.]])
  partly = RoundUploads((nobody[0], round_uploads()[1]))
  np.testing.assert_allclose(partly.group_mean('x', previous=(arr(-1.), arr(-2.))), [[-1.], [8.]])


def test_class_means_average_each_class_over_its_holders_without_weights():
  """Class 0: held by the slots with 1, 3 and 8 -> 4; class 1: by the 3 and 8 slots (the first holds none) -> 30;
  the empty slot's 50s never count."""
  means, present = round_uploads().class_mean('protos')
  np.testing.assert_allclose(means, [(1 + 3 + 8) / 3, (20 + 40) / 2])
  np.testing.assert_array_equal(present, [True, True])


def test_ragged_row_axes_are_padded_with_zeros_across_groups():
  a = Uploads({'rows': arr([1., 2.])}, jnp.array([True]), arr(1.))
  b = Uploads({'rows': arr([3., 4., 5.])}, jnp.array([True]), arr(1.))
  np.testing.assert_allclose(RoundUploads((a, b)).every('rows').values, [[1, 2, 0], [3, 4, 5]])


def test_server_step_hands_the_method_the_rounds_uploads_and_they_cross_jit():
  seen = []

  def server_update(server, uploads, key):
    seen.append(type(uploads))
    return {'mean': uploads.mean('x', by='rows')}, {}
  phase = Phase('p', client=None, server_update=server_update)
  new, _ = jax.jit(server_step(phase, None))({}, tuple(round_uploads()), jax.random.PRNGKey(0))
  assert seen == [RoundUploads]
  np.testing.assert_allclose(new['mean'], 5.8)
  doubled = jax.jit(lambda u: jax.tree.map(lambda a: 2 * a, u))(round_uploads())  # a pytree of its groups
  assert isinstance(doubled, RoundUploads) and float(doubled.mean('x')) == 2 * 4.0


def test_a_records_fields_are_its_parts_for_traffic_and_reductions():
  from typing import NamedTuple

  from fedjax_het.core import leaf_scalars
  from fedjax_het.uploads import parts, with_parts

  class Upload(NamedTuple):
    protos: jnp.ndarray
    counts: jnp.ndarray

  up = Upload(jnp.zeros((3, 4)), jnp.ones(3))
  assert list(parts(up)) == ['protos', 'counts'] and parts({'a': 1}) == {'a': 1}
  assert list(parts(jnp.ones(2))) == ['all']
  assert leaf_scalars(up) == {'protos': 12, 'counts': 3} and leaf_scalars(jnp.ones(2)) == {'all': 2}
  replaced = with_parts(up, {'counts': jnp.zeros(3)})
  assert isinstance(replaced, Upload) and float(replaced.counts.sum()) == 0.0
  # a reduction names a record's field as it names a dict's key
  uploads = RoundUploads((Uploads(Upload(jnp.stack([jnp.ones((3, 4)), 3 * jnp.ones((3, 4))]), jnp.ones((2, 3))),
                                  jnp.array([True, True]), jnp.ones(2)),))
  np.testing.assert_allclose(uploads.mean('protos'), 2.0)
