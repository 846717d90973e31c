"""Robust aggregation of the models a server averages: what Flower's FedMedian, FedTrimmedAvg and norm bounding
do, for every method whose server reads its clients' models only through means over the participants (of each
architecture group, or of all of them).

The math is pure jnp over a stacked client axis: values [S, ...] with a mask [S] of the slots that hold a
participant (an empty slot, an absent or rejected client, counts for nothing):

- `masked_median`: per coordinate, the median of the participants' values (the mean of the two middle ones for an
  even count); unweighted, as FedMedian.
- `masked_trimmed_mean`: per coordinate, the mean of the participants' values after dropping floor(trim * n) of
  the lowest and as many of the highest (n participants); unweighted, as FedTrimmedAvg.
- `bound_norms`: each participant's update (its upload minus the model it received) scaled down to L2 norm at most
  `multiplier` times the median norm of the participants' updates; the method's own weights then average them.

`robust_aggregation(algorithm, RobustConfig(...))` returns the `Algorithm` whose server steps see each averaged
part (the parts the method's `UploadPrivacy.reference` names, measured from what the clients received) replaced:
under 'median' and 'trimmed_mean' every participant's copy becomes the statistic of its group's participants (of
all participants where the server averages across groups, `UploadPrivacy.aggregate='sum'`), so the server's own
weighted mean of them is that statistic; under 'norm_bound' every update beyond the bound is scaled down to it (an
update within it is passed unchanged). A method whose server does anything else with its uploads is refused.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp

from fedjax_het.core import Algorithm, Phase, UploadPrivacy
from fedjax_het.errors import ConfigError, setting
from fedjax_het.uploads import RoundUploads, Uploads, parts as parts_of, with_parts

MODES = ('none', 'median', 'trimmed_mean', 'norm_bound')


@dataclasses.dataclass(frozen=True)
class RobustConfig:
  """mode: 'none' (the method's own mean), 'median', 'trimmed_mean' or 'norm_bound'; trim: the share of the
  participants dropped at each end of every coordinate under 'trimmed_mean' (floor(trim * n) each side, in
  [0, 0.5)); multiplier: under 'norm_bound', an update's L2 norm is bounded by multiplier x the round's median
  update norm (> 0)."""
  mode: str = 'none'
  trim: float = 0.2
  multiplier: float = 2.0

  def __post_init__(self):
    if self.mode not in MODES:
      raise ConfigError(f'{setting(self, "mode")} must be one of {", ".join(MODES)}. Fix: RobustConfig.mode='
                        f'\'none\' (the method\'s own mean) or one of the others.')
    if not (math.isfinite(self.trim) and 0 <= self.trim < 0.5):
      raise ConfigError(f'{setting(self, "trim")} must be in [0, 0.5): the share of the participants dropped at '
                        f'each end of every coordinate. Fix: RobustConfig.trim=0.2 (FedTrimmedAvg\'s beta), or '
                        f'above 1/3 to trim one of three.')
    if not (math.isfinite(self.multiplier) and self.multiplier > 0):
      raise ConfigError(f'{setting(self, "multiplier")} must be a positive number: an update\'s norm is bounded '
                        f'by it times the round\'s median update norm. Fix: RobustConfig.multiplier=2.0.')


# ---------------------------------------------------------------- the math over a stacked client axis
def _sorted_participants(values: jnp.ndarray, mask: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
  """(values sorted along axis 0 with the empty slots last, the number of participants)."""
  m = mask.astype(bool).reshape(mask.shape + (1,) * (values.ndim - 1))
  return jnp.sort(jnp.where(m, values, jnp.inf), axis=0), jnp.sum(mask.astype(bool)).astype(jnp.int32)


def masked_median(values: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
  """Per coordinate, the median over axis 0 of the rows where `mask` [S] is set (the mean of the two middle values
  for an even count); zeros where no row is set."""
  if not values.shape[0]:
    return jnp.zeros(values.shape[1:], values.dtype)
  ordered, n = _sorted_participants(values, mask)
  low = jnp.take(ordered, jnp.maximum((n - 1) // 2, 0), axis=0)
  high = jnp.take(ordered, n // 2, axis=0)
  return jnp.where(n > 0, (low + high) / 2, jnp.zeros_like(low))


def masked_trimmed_mean(values: jnp.ndarray, mask: jnp.ndarray, trim: float) -> jnp.ndarray:
  """Per coordinate, the mean over axis 0 of the rows where `mask` [S] is set, after dropping t = floor(trim * n)
  of the lowest and t of the highest values (n rows set); zeros where no row is set."""
  if not values.shape[0]:
    return jnp.zeros(values.shape[1:], values.dtype)
  ordered, n = _sorted_participants(values, mask)
  t = jnp.floor(trim * n.astype(jnp.float32)).astype(jnp.int32)
  rank = jnp.arange(values.shape[0]).reshape((-1,) + (1,) * (values.ndim - 1))
  kept = (rank >= t) & (rank < n - t)
  total = jnp.sum(jnp.where(kept, ordered, 0), axis=0)
  return jnp.where(n > 0, total / jnp.maximum(n - 2 * t, 1).astype(values.dtype), jnp.zeros_like(total))


def update_norms(deltas: Any, mask: jnp.ndarray) -> jnp.ndarray:
  """[S]: the L2 norm of each slot's update (every leaf of `deltas` [S, ...] together); 0 in an empty slot."""
  squares = sum(jnp.sum(jnp.reshape(a, (a.shape[0], -1)).astype(jnp.float32) ** 2, axis=1)
                for a in jax.tree.leaves(deltas))
  return jnp.where(mask.astype(bool), jnp.sqrt(squares), 0.0)


def bound_norms(deltas: Any, mask: jnp.ndarray, multiplier: float) -> tuple[Any, jnp.ndarray, jnp.ndarray]:
  """(each participant's update scaled to L2 norm at most `multiplier` x the median of the participants' update
  norms, that bound, [S] which were scaled down). An update within the bound, and an empty slot, is unchanged."""
  norms = update_norms(deltas, mask)
  bound = multiplier * masked_median(norms, mask)
  scaled = mask.astype(bool) & (norms > bound)
  factor = jnp.where(scaled, bound / jnp.maximum(norms, 1e-30), 1.0)

  def scale(a):
    f = factor.reshape((-1,) + (1,) * (a.ndim - 1)).astype(a.dtype)
    return jnp.where(scaled.reshape(f.shape), a * f, a)
  return jax.tree.map(scale, deltas), bound, scaled


def tree_statistic(tree: Any, mask: jnp.ndarray, cfg: RobustConfig) -> Any:
  """`masked_median` or `masked_trimmed_mean` (cfg.mode) of every floating leaf of `tree` [S, ...]; others as
  they are in the first slot."""
  def one(a):
    if not jnp.issubdtype(a.dtype, jnp.floating):
      return a[0]
    return masked_median(a, mask) if cfg.mode == 'median' else masked_trimmed_mean(a, mask, cfg.trim)
  return jax.tree.map(one, tree)


# ---------------------------------------------------------------- a round's uploads
def averaged_parts(declared: UploadPrivacy) -> Optional[str]:
  """Over which participants the server averages the parts the method declares models ('group': each
  architecture group's, 'all': every group's), or None where its server reads its uploads otherwise (then there
  is no average to make robust)."""
  if declared.reference is None or declared.holds is not None:
    return None
  return {'group_sum': 'group', 'sum': 'all'}.get(declared.aggregate)


def robust_uploads(uploads: Sequence[Uploads], references: Sequence[dict], scope: str, cfg: RobustConfig
                   ) -> tuple[tuple, dict]:
  """The groups' `Uploads` with each part named in `references` (one {part: the model the group's clients
  received} per group) made robust over the participants of each group (`scope` 'group') or of all groups
  ('all'), and the step's metrics ('robust_clipped': the participants whose update was scaled down, under
  'norm_bound')."""
  names = tuple(references[0])
  blocks = [list(range(len(uploads)))] if scope == 'all' else [[g] for g in range(len(uploads))]
  out = list(uploads)
  clipped = jnp.asarray(0, jnp.int32)
  for block in blocks:
    sizes = [uploads[g].mask.shape[0] for g in block]
    mask = jnp.concatenate([uploads[g].mask.astype(bool) for g in block])
    values = {n: jax.tree.map(lambda *a: jnp.concatenate(a), *[parts_of(uploads[g].values)[n] for g in block])
              for n in names}
    if cfg.mode == 'norm_bound':
      reference = {n: jax.tree.map(lambda *r: jnp.concatenate([jnp.broadcast_to(x, (s,) + x.shape)
                                                               for x, s in zip(r, sizes)]),
                                   *[references[g][n] for g in block]) for n in names}
      floating = lambda a: jnp.issubdtype(a.dtype, jnp.floating)
      deltas = jax.tree.map(lambda v, r: v - r if floating(v) else jnp.zeros_like(v), values, reference)
      bounded, _, scaled = bound_norms(deltas, mask, cfg.multiplier)
      keep = lambda s, a: jnp.reshape(s, (-1,) + (1,) * (a.ndim - 1))
      new = jax.tree.map(lambda v, r, d: jnp.where(keep(scaled, v), r + d, v) if floating(v) else v,
                         values, reference, bounded)
      clipped = clipped + jnp.sum(scaled).astype(jnp.int32)
    else:
      statistic = tree_statistic(values, mask, cfg)
      new = jax.tree.map(lambda v, s: jnp.where(jnp.reshape(mask, (-1,) + (1,) * (v.ndim - 1)), s[None], v)
                         if jnp.issubdtype(v.dtype, jnp.floating) else v, values, statistic)
    offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    for i, g in enumerate(block):
      own = {n: jax.tree.map(lambda a, i=i: a[offsets[i]:offsets[i + 1]], new[n]) for n in names}
      out[g] = uploads[g]._replace(values=with_parts(uploads[g].values, own))
  return tuple(out), ({'robust_clipped': clipped} if cfg.mode == 'norm_bound' else {})


def _robust_phase(phase: Phase, declared: UploadPrivacy, scope: str, cfg: RobustConfig) -> Phase:
  inner = phase.server_update

  def of_spec(spec):
    step = inner(spec) if phase.server_of_spec else inner

    def server_update(server, uploads, key, *constants):
      references = [declared.reference(phase.broadcast(server, g)) for g in spec.groups]
      robust, metrics = robust_uploads(tuple(uploads), references, scope, cfg)
      server, own = step(server, RoundUploads(robust), key, *constants)
      return server, {**own, **metrics}
    return server_update
  return dataclasses.replace(phase, server_of_spec=True, server_update=of_spec)


def robust_aggregation(algorithm: Algorithm, cfg: Optional[RobustConfig]) -> Algorithm:
  """`algorithm` whose server steps aggregate its clients' models robustly (the module docstring); unchanged for
  mode 'none'. A ConfigError for a method whose server does not read its uploads only through means of models over
  the participants (its `UploadPrivacy`: a reference, aggregate 'sum' or 'group_sum', every entry held by all)."""
  if cfg is None or cfg.mode == 'none':
    return algorithm
  declared = algorithm.upload_privacy
  scope = averaged_parts(declared)
  if scope is None:
    raise ConfigError(f'{setting(cfg, "mode")}: {algorithm.name}\'s server does not read its clients\' uploads only '
                      f'through means of the models they received and trained, so there is no average to make '
                      f'robust. Fix: RobustConfig.mode=\'none\', or a method that averages models (fedavg, fedprox, '
                      f'fedala, lg_fedavg, avgkd, fml, fedmrl, fedtype, pfedafm; docs/distributed.md).')
  phases = tuple(_robust_phase(phase, declared, scope, cfg) for phase in algorithm.phases)
  return dataclasses.replace(algorithm, phases=phases)
