"""Optimizers the methods share, as optax transformations: torch.optim.Adam with a rate set at every step (the
generators' DDPM decay, Felo's MultiStepLR driven by the server's round counter)."""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax


def torch_adam(learning_rate: float, b1: float = 0.9, b2: float = 0.999, weight_decay: float = 0.0
               ) -> optax.GradientTransformation:
  """torch.optim.Adam (eps 1e-8; weight decay an L2 term added to the gradient before the moments, not AdamW's),
  its rate an injected hyperparameter that `step_at_rate` sets."""
  def adam(learning_rate):
    parts = [optax.add_decayed_weights(weight_decay)] if weight_decay else []
    return optax.chain(*parts, optax.adam(learning_rate, b1, b2, eps=1e-8))
  return optax.inject_hyperparams(adam)(learning_rate=learning_rate)


def step_at_rate(optimizer: optax.GradientTransformation, params: Any, grads: Any, opt_state: Any, rate
                 ) -> tuple[Any, Any]:
  """(params after one update at learning rate `rate`, the new state) of an optimizer built by
  `optax.inject_hyperparams` with a 'learning_rate' (`torch_adam`)."""
  rate = jnp.asarray(rate, jnp.float32)
  opt_state = opt_state._replace(hyperparams={**opt_state.hyperparams, 'learning_rate': rate})
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def multistep_factor(round_index: Any, milestones: Sequence[int], gamma: float) -> jnp.ndarray:
  """torch's MultiStepLR stepped once per round: the factor gamma^k on the base rate in round `round_index`
  (0-based, traced or not), k the milestones at or before it."""
  passed = sum((jnp.asarray(round_index) >= m).astype(jnp.float32) for m in milestones)
  return jnp.float32(gamma) ** passed


class TorchAmsgradState(NamedTuple):
  """The moments torch's Adam(amsgrad=True) keeps: step count, first and second moments, the running maximum of the
  (uncorrected) second moment."""
  count: jnp.ndarray
  mu: Any
  nu: Any
  nu_max: Any


def torch_amsgrad(learning_rate: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
                  ) -> optax.GradientTransformation:
  """torch.optim.Adam(amsgrad=True): the maximum is taken over the uncorrected second moments and the bias correction
  applied after it, lr * (mu / (1 - b1^t)) / (sqrt(max nu) / sqrt(1 - b2^t) + eps). (optax.amsgrad takes the maximum
  of the corrected moments, which differs while the correction changes: FedGKT's clients and server step with this.)"""
  def init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return TorchAmsgradState(jnp.zeros([], jnp.int32), zeros, zeros, zeros)

  def update(grads, state, params=None):
    count = state.count + 1
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, grads)
    nu_max = jax.tree.map(jnp.maximum, state.nu_max, nu)
    t = count.astype(jnp.float32)
    step = learning_rate / (1 - b1 ** t)
    root = jnp.sqrt(1 - b2 ** t)
    updates = jax.tree.map(lambda m, v: -step * m / (jnp.sqrt(v) / root + eps), mu, nu_max)
    return updates, TorchAmsgradState(count, mu, nu, nu_max)
  return optax.GradientTransformation(init, update)
