"""TensorBoard scalars beside metrics.jsonl (`--tensorboard`): every number of a round's metrics row, at step =
the round, in the workdir's tensorboard/ folder, written by tensorboardX (no TensorFlow needed).

`tensorboard --logdir=WORKDIR` shows one run; `--logdir` on a comparison's folder (experiments/compare.py writes
one workdir per method and seed) overlays them all. A resumed run purges the steps after its checkpoint, so the
rounds it runs again replace those a killed run had logged.
"""

from __future__ import annotations

import numbers
from typing import Optional

from fedjax_het.errors import ConfigError

FOLDER = 'tensorboard'


def summary_writer_class():
  """tensorboardX's SummaryWriter, or a ConfigError saying how to install it (checked before a run starts)."""
  try:
    from tensorboardX import SummaryWriter
  except ImportError:
    raise ConfigError("--tensorboard needs tensorboardX, which is not installed. Fix: pip install "
                      "'fedjax_het[tensorboard]' (or drop --tensorboard).") from None
  return SummaryWriter


class ScalarLog:
  """The TensorBoard event file of one run: `write(row)` per round, `close()` at the end."""

  def __init__(self, directory: str, resumed_after: Optional[int] = None):
    SummaryWriter = summary_writer_class()
    purge = resumed_after + 1 if resumed_after else None  # steps from here on are written again
    self._writer = SummaryWriter(directory, purge_step=purge)

  def write(self, row: dict) -> None:
    """Each numeric entry of a metrics row (not lists, strings or flags) as a scalar at step row['round']."""
    step = int(row['round'])
    for name, value in row.items():
      if name != 'round' and isinstance(value, numbers.Real) and not isinstance(value, bool):
        self._writer.add_scalar(name, float(value), step)
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()
