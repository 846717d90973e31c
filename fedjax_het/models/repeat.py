"""A run of identical blocks applied as one `lax.scan` step, with each block's variables kept under its own name.

A ResNet-152 repeats one bottleneck 35 times in its third stage and a ViT-B one encoder block 12 times; unrolled,
every repetition is traced, lowered and compiled again, which is most of a deep model's start-up. With
`scan=True`, `apply_blocks` traces the block once and runs it over the run's variables stacked along a new axis
(`lax.scan`). The parameter tree is the unrolled one (`Bottleneck_5`, `EncoderBlock_3`, ...), so checkpoints, the
methods' parameter arithmetic and every test of the layout are the same either way, and so are the numbers up to
float32 rounding (the same operations on the same values; XLA may fuse them differently inside the loop). The
price is the stacking: each application copies the run's variables into one array per leaf (and its gradient back
out), and XLA optimises less across a loop's iterations. On the CPU it does not pay (docs/performance.md: the start
of a ResNet-152 or ViT-B/16 a few seconds shorter, each FedRE round 30-50 % longer); it is there to be measured
where compilation is the start's cost.

Initialisation always unrolls, so that every block draws its own parameters exactly as without the scan."""

from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

MIN_SCANNED = 2  # a shorter run gains nothing from a loop


def apply_blocks(parent: nn.Module, make: Callable[..., nn.Module], names: Sequence[str], x: jnp.ndarray, *args,
                 scan: bool = False) -> jnp.ndarray:
  """x through the blocks `make(name=n)` for n in names, in order, each block mapping x to an array of x's shape
  and taking `args` after it; within `parent`'s compact method. With `scan` (and at least MIN_SCANNED blocks,
  outside initialisation) the blocks' variables are stacked and one block, traced once, is scanned over them; the
  mutable collections among them (BatchNorm's statistics in train mode) are written back under each block's name.
  A block must not draw random numbers when scanned."""
  if not scan or len(names) < MIN_SCANNED or parent.is_initializing():
    for name in names:
      x = make(name=name)(x, *args)
    return x
  collections = [c for c in ('params', 'batch_stats') if parent.has_variable(c, names[0])]
  stacked = {c: jax.tree.map(lambda *leaves: jnp.stack(leaves), *[parent.get_variable(c, n) for n in names])
             for c in collections}
  mutable = [c for c in collections if c != 'params' and parent.is_mutable_collection(c)]
  block = make(parent=None)

  def step(h, variables):  # (the block's output, its updated mutable collections)
    if mutable:
      return block.apply(variables, h, *args, mutable=mutable)
    return block.apply(variables, h, *args), None

  x, updated = lax.scan(step, x, stacked)
  for c in mutable:
    for i, name in enumerate(names):
      parent.put_variable(c, name, jax.tree.map(lambda a: a[i], updated[c]))
  return x
