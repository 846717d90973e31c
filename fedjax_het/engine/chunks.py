"""How the vmap executor cuts a round's participants into chunks: no client waits on a much larger one.

A vmapped call runs its clients' local loops in lock step, for as many steps as its busiest client takes; every
other client's extra steps are computed and thrown away. `plan_chunks` sorts the participants by their work
(local steps, or rows to score), largest first, and cuts the sorted list into chunks whose widths come from a
short ladder (`width_ladder`: a fixed set, so the number of compiled programs does not grow with the population),
each as wide as it can be while its computed work stays within `tolerance` of its useful work. Any number of
participants is a sum of ladder widths, so no chunk holds an empty slot unless the client mesh asks for widths that
are multiples of its devices.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# Each ladder width is this many times the next: few compiled widths, few calls for a remainder.
LADDER_RATIO = 4


class Chunk(NamedTuple):
  """One vmapped call: `positions` index the participants (sorted by work, largest first); `width` is the call's
  client axis (>= len(positions): the slots past them are empty); `work` the largest work among them."""
  positions: np.ndarray
  width: int
  work: int


def width_ladder(max_width: int, multiple: int = 1) -> tuple[int, ...]:
  """The chunk widths, widest first: multiple * max_width / 4^k down to `multiple` (max_width rounded down to a
  power of LADDER_RATIO, at least 1)."""
  top = 1
  while top * LADDER_RATIO <= max(max_width // multiple, 1):
    top *= LADDER_RATIO
  widths = []
  while top >= 1:
    widths.append(top * multiple)
    top //= LADDER_RATIO
  return tuple(widths)


def plan_chunks(work: np.ndarray, max_width: int, tolerance: float = 1.15, multiple: int = 1) -> list[Chunk]:
  """The chunks of participants with `work` [m] (e.g. each one's local steps), in order of decreasing work
  (ties: in the order given).

  From the largest remaining participant on, a chunk takes the widest ladder width w (`width_ladder`) that fits
  the participants left and keeps w * work[first] <= tolerance * (their summed work); the narrowest width always
  fits. With `multiple` > 1 (a client mesh of that many devices) every width is a multiple of it and the last
  chunk may hold empty slots."""
  work = np.asarray(work, np.int64)
  order = np.argsort(-work, kind='stable')
  sorted_work = work[order]
  widths = width_ladder(max_width, multiple)
  chunks, i, m = [], 0, len(order)
  while i < m:
    for w in widths:
      take = min(w, m - i)
      if take < w and w != widths[-1]:
        continue  # a wider call than the participants left: a narrower one fits them without empty slots
      busiest = int(sorted_work[i])
      if w == widths[-1] or w * busiest <= tolerance * int(sorted_work[i:i + take].sum()):
        chunks.append(Chunk(order[i:i + take], w, busiest))
        i += take
        break
  return chunks


def padding_waste(work: np.ndarray, chunks: list[Chunk]) -> float:
  """Computed work over useful work of a chunk plan (1.0: nothing thrown away): every slot of a chunk computes
  its busiest client's work."""
  useful = int(np.sum(work))
  computed = sum(c.width * c.work for c in chunks)
  return computed / useful if useful else 1.0
