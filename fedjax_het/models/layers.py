"""Flax's Conv and Dense layers whose applications trace only what they compute.

Flax's `Scope.param`, applying a module whose parameter exists, checks the parameter's shape by tracing its
initialiser abstractly (a random draw per kernel, e.g. a truncated normal), at every application of every layer:
in a deep classifier's training step, a sixth of the time JAX spends tracing it. These layers read an existing
parameter as it is (initialising, they are flax's own: the same variables, names and draws); a parameter of a
wrong shape then fails in the layer's own operation rather than in flax's check. The shapes are those the engine
initialised (`engine.groups.check_architecture`), restored checkpoints are checked against them, and the engine's
modules apply only their own variables.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
from flax.core import meta


def given_param(module: nn.Module, name: str, init_fn, *init_args, unbox: bool = True, **init_kwargs) -> Any:
  """`module.param(name, init_fn, ...)` without flax's shape check of an existing parameter: the parameter as it is
  when the module is applied to variables holding it, flax's initialisation otherwise."""
  if module.has_variable('params', name):
    value = module.get_variable('params', name)
    return meta.unbox(value) if unbox else value
  return nn.Module.param(module, name, init_fn, *init_args, unbox=unbox, **init_kwargs)


class Conv(nn.Conv):
  """`flax.linen.Conv` reading its existing parameters without re-tracing their initialisers (`given_param`)."""

  @nn.nowrap  # a plain method, as flax's own `param` (a wrapped module method costs more to call than the check)
  def param(self, name: str, init_fn, *init_args, unbox: bool = True, **init_kwargs) -> Any:
    return given_param(self, name, init_fn, *init_args, unbox=unbox, **init_kwargs)


class Dense(nn.Dense):
  """`flax.linen.Dense` reading its existing parameters without re-tracing their initialisers (`given_param`)."""

  @nn.nowrap  # a plain method, as flax's own `param` (a wrapped module method costs more to call than the check)
  def param(self, name: str, init_fn, *init_args, unbox: bool = True, **init_kwargs) -> Any:
    return given_param(self, name, init_fn, *init_args, unbox=unbox, **init_kwargs)
