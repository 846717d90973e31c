"""The shapes of a module's outputs and variables for an input shape, traced abstractly once per (module, shape).

A federation reads them several times while it is built (the architecture check, the parameter count, the shapes
of an optimizer state, of what a client uploads), and a notebook or a sweep builds federations of the same
architectures again and again; tracing a deep model's forward pass, even abstractly, takes up to a few seconds."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp


def cached_when_hashable(maxsize: int):
  """functools.lru_cache(maxsize) for calls whose arguments all hash; a call with an unhashable one (a user's own
  module, say) is computed afresh."""
  def wrap(fn):
    cached = functools.lru_cache(maxsize=maxsize)(fn)

    @functools.wraps(fn)
    def call(*args):
      try:
        hash(args)
      except TypeError:
        return fn(*args)
      return cached(*args)
    return call
  return wrap


def init_shapes(module: Any, input_shape: tuple, **kwargs: Any) -> tuple[Any, Any]:
  """(outputs, variables) of `module.init_with_output(key, zeros((1,) + input_shape), **kwargs)` as
  `jax.ShapeDtypeStruct` trees (kwargs static, e.g. `train=False`), traced once per equal module, shape and kwargs.
  Returned in fresh containers: a caller may edit its dicts."""
  return jax.tree.map(lambda s: s, _init_shapes(module, tuple(input_shape), tuple(sorted(kwargs.items()))))


def variable_shapes(module: Any, input_shape: tuple) -> dict:
  """The shapes of the variables (`{'params': ..., other collections}`) of `module` initialised in eval mode on one
  input of `input_shape`."""
  return init_shapes(module, input_shape, train=False)[1]


@cached_when_hashable(maxsize=256)
def _init_shapes(module: Any, input_shape: tuple, kwargs: tuple) -> tuple[Any, Any]:
  return jax.eval_shape(lambda: module.init_with_output(jax.random.PRNGKey(0), jnp.zeros((1,) + input_shape),
                                                         **dict(kwargs)))
