"""What the server receives in a round and its reductions over the participants (DrJAX's `reduce_mean` /
`reduce_sum` over the client axis): one `Uploads` per architecture group, gathered as `RoundUploads`, whose
reductions own the participation masks and the concatenation of the groups, so that a server step reads

    uploads.mean('global_model', by='rows', previous=server['global_model'])   # FedAvg of a shared part
    uploads.class_mean('protos')                                               # FedProto's Eq. 6

instead of casting masks and concatenating groups by hand.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp

Part = Union[None, str, Callable[[Any], Any]]
WEIGHTINGS = ('uniform', 'rows')


class Uploads(NamedTuple):
  """One group's uploads in a round: values (the programs' uploads stacked over slots [S, ...]), mask [S] (the
  slots that hold a participant), num_train [S] (their training rows, float: sample weights the server knows),
  client [S] (each slot's client, its index in the group; the group's size or more for an empty slot: where a
  server keeps something per client, FedGKT's logits of its rows); expected [S]: under Poisson sampling, the
  number of participants the round's draw expects over all groups (rate x clients), in every slot, by which a DP
  server divides its sums (a fixed denominator, `privacy.dp`); None under a fixed-size draw."""
  values: Any
  mask: jnp.ndarray
  num_train: jnp.ndarray
  client: Optional[jnp.ndarray] = None
  expected: Optional[jnp.ndarray] = None

  def weights(self, by: str = 'uniform') -> jnp.ndarray:
    """Each slot's weight [S] in a mean over the participants: 1 ('uniform') or its training rows ('rows'), 0 for
    an empty slot."""
    if by not in WEIGHTINGS:
      raise ValueError(f'weights(by={by!r}): choose one of {", ".join(WEIGHTINGS)}.')
    mask = self.mask.astype(jnp.float32)
    return mask * self.num_train if by == 'rows' else mask

  def mean(self, part: Part = None, *, by: str = 'uniform', previous: Any = None) -> Any:
    """The weighted mean of `part` over this group's participants (`weights(by)`); with `previous`, that value
    where nobody participated (else zeros)."""
    values = _select(self.values, part)
    if previous is None:
      return weighted_average(values, self.weights(by))
    return participant_average(values, self.weights(by), previous)

  def participant_rows(self, part: str) -> jnp.ndarray:
    """[S, n]: which of each slot's n uploaded rows are real (values[part] [S, n] bool) in a participant's slot;
    False throughout an empty slot."""
    return parts(self.values)[part] & self.mask[:, None].astype(bool)

  def holds(self, counts: str = 'counts') -> jnp.ndarray:
    """[S, C]: whether each slot's participant holds each class (values[counts] [S, C] rows per class > 0)."""
    return holders(parts(self.values)[counts], self.mask)


def concat_groups(uploads) -> Uploads:
  """All groups' `Uploads` as one, concatenated along the slot axis; ragged row axes (e.g. FedAllRep's rows) are
  zero-padded to the longest."""
  def pad_to(a, shape):
    return jnp.pad(a, [(0, t - s) for s, t in zip(a.shape, shape)])

  def cat(*leaves):
    shape = tuple(max(s) for s in zip(*(leaf.shape for leaf in leaves)))
    return jnp.concatenate([pad_to(leaf, (leaf.shape[0],) + shape[1:]) for leaf in leaves])
  return jax.tree.map(cat, *uploads)


def masked_mean(values: jnp.ndarray, mask: jnp.ndarray, axis: int = 0) -> jnp.ndarray:
  """Mean of `values` over `axis` counting only rows where `mask` is nonzero (0 where the mask is empty)."""
  m = mask.astype(values.dtype).reshape(mask.shape + (1,) * (values.ndim - mask.ndim))
  return jnp.sum(values * m, axis=axis) / jnp.maximum(jnp.sum(m, axis=axis), 1e-12)


def weighted_average(tree: Any, weights: jnp.ndarray) -> Any:
  """sum_k w_k tree_k / sum_k w_k over the leading client axis of every leaf."""
  w = weights / jnp.maximum(weights.sum(), 1e-12)
  return jax.tree.map(lambda a: jnp.tensordot(w.astype(a.dtype), a, axes=1), tree)


def participant_average(tree: Any, weights: jnp.ndarray, previous: Any) -> Any:
  """`weighted_average` over the participants (weights 0 elsewhere), or `previous` when nobody participated:
  the server step of LG-FedAvg's heads, FedGen's heads and FML's global models."""
  mean = weighted_average(tree, weights)
  return jax.tree.map(lambda m, old: jnp.where(weights.sum() > 0, m, old), mean, previous)


def holders(counts: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
  """[K, C]: whether each participant (mask [K]) holds each class (counts [K, C] rows per class > 0)."""
  return (counts > 0) & mask[:, None].astype(bool)


def aggregate_class_means(means: jnp.ndarray, counts: jnp.ndarray, mask: jnp.ndarray
                          ) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Server aggregation of per-class means (FedProto Eq. 6, FD's logits): the unweighted mean over the clients
  that hold each class. means [K, C, ...], counts [K, C], mask [K] (participants) -> (global [C, ...] (0 where no
  participant holds the class), present [C] bool)."""
  holds = holders(counts, mask)
  return masked_mean(means, holds, axis=0), holds.any(0)


def parts(tree: Any) -> dict:
  """The named top-level parts of what a method sends: a NamedTuple's fields or a dict's keys, in order (one part
  'all' for anything else). Traffic is counted, and DP declared, per part."""
  if isinstance(tree, dict):
    return tree
  if isinstance(tree, tuple) and hasattr(tree, '_asdict'):
    return tree._asdict()
  return {'all': tree}


def with_parts(tree: Any, new: dict) -> Any:
  """`tree` with the parts in `new` replaced (`parts`' inverse)."""
  if isinstance(tree, dict):
    return {**tree, **new}
  if isinstance(tree, tuple) and hasattr(tree, '_replace'):
    return tree._replace(**new)
  return new.get('all', tree)


def _select(values: Any, part: Part) -> Any:
  if part is None:
    return values
  return parts(values)[part] if isinstance(part, str) else part(values)


class RoundUploads(tuple):
  """A round's uploads: one `Uploads` per architecture group, in group order (a tuple: `uploads[g]`, iteration),
  with reductions over the participants of every group. A part is a key of the uploads' values, a function of one
  group's values (a part shaped alike in every group: GeFL's shared block of each model), or None for all of
  them; each reduction selects it in every group before concatenating the groups."""

  def every(self, part: Part = None) -> Uploads:
    """All groups' slots as one `Uploads` holding `part` (its values concatenated along the slot axis)."""
    return concat_groups(tuple(u._replace(values=_select(u.values, part)) for u in self))

  def mean(self, part: Part = None, *, by: str = 'uniform', previous: Any = None) -> Any:
    """The weighted mean of `part` over the participants of every group (`Uploads.weights(by)`: 'uniform' or
    'rows', FedAvg's sample weights); with `previous`, that value where nobody participated (else zeros)."""
    return self.every(part).mean(by=by, previous=previous)

  def group_mean(self, part: Part = None, *, by: str = 'uniform', previous: Any = None) -> tuple:
    """`Uploads.mean` of each group on its own (grouped FedAvg: a model per architecture); previous: one value
    per group, kept by a group nobody of which participated."""
    if previous is None:
      return tuple(u.mean(part, by=by) for u in self)
    return tuple(u.mean(part, by=by, previous=old) for u, old in zip(self, previous))

  def sum(self, part: Part = None) -> Any:
    """The sum of `part` over the participants."""
    u = self.every(part)
    mask = u.mask.astype(jnp.float32)
    return jax.tree.map(lambda a: jnp.tensordot(mask.astype(a.dtype), a, axes=1), u.values)

  def class_mean(self, part: str, counts: str = 'counts') -> tuple[jnp.ndarray, jnp.ndarray]:
    """Per-class means uploaded as values[part] [C, ...] with values[counts] [C] rows per class, averaged without
    weights over the participants that hold each class (`aggregate_class_means`): (means [C, ...], present [C])."""
    u = self.every(lambda values: {part: parts(values)[part], counts: parts(values)[counts]})
    return aggregate_class_means(u.values[part], u.values[counts], u.mask)


jax.tree_util.register_pytree_node(RoundUploads, lambda r: (tuple(r), None), lambda _, groups: RoundUploads(groups))
