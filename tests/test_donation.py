"""engine/donation.py's ConsumingJit, and the sequential executor's use of it: a consumed argument's leaves are
donated exactly where an output can take them, the numbers are those of a plain jit, and a caller's client is
consumed only when the caller says it holds no other reference to it."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_het.core import for_client
from fedjax_het.engine.donation import ConsumingJit
from fedjax_het.engine.groups import host_copy
from fedjax_het.engine.sequential_executor import SequentialExecutor
from fedjax_het.methods import FedREConfig, fedre
from test_engine import make_fed


def test_the_leaves_an_output_can_take_are_donated_and_the_others_kept():
  traces = []

  def fn(c, y):
    traces.append(1)
    return {'a': c['a'] + 1.0, 'total': jnp.sum(c['b'])}, y * 2
  consuming = ConsumingJit(fn)
  c = {'a': jnp.arange(4.0), 'b': jnp.ones(3)}  # f32[4] has an output of its shape, f32[3] none
  with warnings.catch_warnings():
    warnings.simplefilter('error')  # JAX warns of a donated buffer it could not use
    out, doubled = consuming(c, 3 * jnp.ones(2))
  np.testing.assert_array_equal(out['a'], [1, 2, 3, 4])
  assert float(out['total']) == 3.0
  np.testing.assert_array_equal(doubled, [6, 6])
  assert c['a'].is_deleted() and not c['b'].is_deleted()
  before = len(traces)
  again = {'a': jnp.zeros(4), 'b': 2 * jnp.ones(3)}
  assert float(consuming(again, jnp.ones(2))[0]['total']) == 6.0
  assert len(traces) == before  # the same structure: no new trace
  assert again['a'].is_deleted() and not again['b'].is_deleted()


def test_two_leaves_of_one_shape_are_donated_only_as_far_as_outputs_of_it_go():
  consuming = ConsumingJit(lambda c: c[0] * c[1])
  c = (jnp.full(3, 2.0), jnp.full(3, 5.0))
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    np.testing.assert_array_equal(consuming(c), [10, 10, 10])
  assert [leaf.is_deleted() for leaf in c] == [True, False]


def test_a_client_round_consumes_the_callers_state_only_when_it_owns_it(tiny_data):
  fed = make_fed(tiny_data, 'sequential', fedre(FedREConfig(), tiny_data.num_classes))
  state = fed.init()
  g, program, key = fed.groups[0], fed.programs[0][0], fed.round_keys(0)[0]
  broadcast = for_client(fed.broadcast(state.server, 0, 0), 0)
  client = host_copy(state.groups[0], 0)
  kept = fed.executor.run_one(g, program, 0, 0, client, broadcast, key)
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(client))
  consumed = fed.executor.run_one(g, program, 0, 0, client, broadcast, key, owned=True)
  assert jax.tree.leaves(client)[0].is_deleted()
  for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(consumed)):
    np.testing.assert_array_equal(a, b)


def test_a_one_client_stack_is_unstacked_and_restacked_without_a_copy():
  functions = SequentialExecutor(16).stack_functions()
  stacked = {'w': jnp.arange(6.0).reshape(1, 2, 3), 'key': jnp.array([[7, 9]], jnp.uint32)}
  pointers = [a.unsafe_buffer_pointer() for a in jax.tree.leaves(stacked)]
  client = functions['unstack'](stacked)
  assert all(a.is_deleted() for a in jax.tree.leaves(stacked))
  np.testing.assert_array_equal(client['w'], [[0, 1, 2], [3, 4, 5]])
  np.testing.assert_array_equal(client['key'], [7, 9])
  assert [a.unsafe_buffer_pointer() for a in jax.tree.leaves(client)] == pointers  # the same memory
  again = functions['restack'](client)
  assert jax.tree.map(jnp.shape, again) == {'w': (1, 2, 3), 'key': (1, 2)}
  assert [a.unsafe_buffer_pointer() for a in jax.tree.leaves(again)] == pointers


def test_a_sequential_round_consumes_a_one_client_group_and_equals_vmaps_round(tiny_data):
  """Client 0 alone in its group (its stack is unstacked in place), the other five in one group."""
  from test_engine import assert_same_run, run
  models = ('small_cnn_narrow',) + ('mlp',) * 5
  sequential = make_fed(tiny_data, 'sequential', models=models)
  assert [g.stacked_size for g in sequential.groups] == [1, 5]
  state = sequential.init()
  alone = jax.tree.leaves(state.groups[0])
  pointers = [a.unsafe_buffer_pointer() for a in alone]
  given = {}
  run_one = sequential.executor.run_one

  def recording(g, program, phase, i, client, *args, **kw):
    given[g.arch] = [a.unsafe_buffer_pointer() for a in jax.tree.leaves(client)]
    return run_one(g, program, phase, i, client, *args, **kw)
  sequential.executor.run_one = recording
  sequential.round(state)
  assert given['small_cnn_narrow'] == pointers  # the client is its stack's memory, not a copy
  assert all(a.is_deleted() for a in alone)
  assert_same_run(run(make_fed(tiny_data, 'vmap', models=models, join_ratio=0.5), 2),
                  run(make_fed(tiny_data, 'sequential', models=models, join_ratio=0.5), 2), exact_accuracy=False,
                  rtol=1e-4, atol=1e-5)
