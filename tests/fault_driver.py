"""Runs the tiny experiment of tests/test_reliability.py in its own process and kills that process with SIGKILL at
one chosen point, for the fault-injection test (kill -9 cannot be caught, so only a real process shows what it
leaves behind).

  python tests/fault_driver.py WORKDIR POINT ROUND [--resume] [--run=NAME] [--stream]

NAME: one of tests/runs.py's FAULT_RUNS (a multi-phase method) instead of the tiny FedAvg run. --stream: the vmap
strategy with client states kept on the host (`stream_clients`).
POINT: 'checkpoint' (inside the checkpoint write of ROUND: its files written, not yet committed), 'metrics' (halfway
through appending ROUND's line of metrics.jsonl), 'round' (inside ROUND's computation), 'none' (run to the end).
"""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import conftest  # noqa: F401,E402 (the test suite's XLA settings and compilation cache)

from fedjax_het.engine.federation import Federation  # noqa: E402
from fedjax_het.run.checkpoints import Checkpoints  # noqa: E402
from fedjax_het.run.experiment import train_and_evaluate  # noqa: E402
from fedjax_het.run.workdir import Workdir  # noqa: E402
from runs import CFG, FAULT_RUNS  # noqa: E402


def die():
  os.kill(os.getpid(), signal.SIGKILL)


def main(workdir: str, point: str, round_: int, resume: bool, cfg=CFG) -> None:
  if point == 'checkpoint':
    # Dies when the checkpoint's files are all in the temporary folder and the commit (its rename) is next: orbax's
    # internal module, so an orbax that moved it fails here loudly instead of killing nowhere.
    from orbax.checkpoint._src.path import atomicity
    assert callable(atomicity.on_commit_callback)

    def save(self, state, identity=None, rows=None):
      if int(state.round) == round_:
        atomicity.on_commit_callback = lambda *args, **kwargs: die()
      return original_save(self, state, identity, rows)
    original_save = Checkpoints.save
    Checkpoints.save = save
  elif point == 'metrics':
    def append(self, row):
      if row['round'] == round_:
        with open(self.file('metrics.jsonl'), 'a') as f:
          line = __import__('json').dumps(row)
          f.write(line[:len(line) // 2])
        die()
      return original_append(self, row)
    original_append = Workdir.append_metrics
    Workdir.append_metrics = append
  elif point == 'round':
    def round_fn(self, state):
      if int(state.round) == round_ - 1:
        die()
      return original_round(self, state)
    original_round = Federation.round
    Federation.round = round_fn
  train_and_evaluate(cfg, workdir, resume=resume, progress=False)


if __name__ == '__main__':
  run = [a.split('=', 1)[1] for a in sys.argv if a.startswith('--run=')]
  cfg = FAULT_RUNS[run[0]][0] if run else CFG
  if '--stream' in sys.argv:
    cfg = __import__('dataclasses').replace(cfg, strategy='vmap', stream_clients=True)
  main(sys.argv[1], sys.argv[2], int(sys.argv[3]), '--resume' in sys.argv, cfg)
