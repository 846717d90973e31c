"""The executor interface: how a group's participants run their `ClientProgram` and how its clients are scored.
Every executor runs exactly the program's and the evaluation's functions, so all compute the same function; their
numbers agree to float32 rounding (they add the same terms in another order).

  VmapExecutor (`engine.vmap_executor`): `jax.vmap(run_client_rows)` over chunks of a group's participants of
      similar work (`engine.chunks`), one jitted call each, the local steps in a loop as long as the chunk's
      busiest client needs. The fast path on accelerators; with a client mesh, each device updates its share of a
      chunk's slots (SPMD); with `stream_clients` the states stay on the host (`engine.streaming`).
  SequentialExecutor (`engine.sequential_executor`): the host walks the participants; each runs init, its real
      local steps and final, each jitted once per group and phase and reused. `threads` clients run at once, one
      host thread each. The fast path on XLA:CPU, which runs convolutions inside while-loops and vmapped (grouped)
      convolutions several times slower.
Executors cache their compiled functions per (name, group, phase); `compiled_functions()` lists them.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_het.core import ClientProgram, Evaluation
from fedjax_het.engine.groups import EvalSet, Group


STRATEGIES = ('vmap', 'sequential')


class Executor:
  """The interface: `run(...)` one round of a group's participants, `correct(...)` its clients' scores."""

  def __init__(self, eval_batch_size: int):
    self.eval_batch_size = eval_batch_size
    self._compiled: dict = {}
    self._lock = threading.Lock()
    self._making: dict = {}  # key -> the lock its maker holds (groups may run in threads, `group_threads`)

  def compiled(self, name: str, *where: Any, make: Callable[[], Any]) -> Any:
    """The function cached under (name, *where), made on first use (once, whichever thread asks first)."""
    key = (name,) + where
    if key not in self._compiled:
      with self._lock:
        making = self._making.setdefault(key, threading.RLock())
      with making:
        if key not in self._compiled:
          self._compiled[key] = make()
    return self._compiled[key]

  def compiled_functions(self) -> list[tuple]:
    """The (name, group, phase) keys of the functions compiled so far (benchmarks read compile counts here)."""
    return list(self._compiled)

  def run(self, g: Group, program: ClientProgram, phase: int, stacked, slot_idx: np.ndarray, broadcast,
          key: jax.Array) -> tuple[Any, Any, jnp.ndarray]:
    """One round of the group's participant slots (slot_idx: local client indices; g.stacked_size marks an empty
    slot): (updated stacked states, uploads stacked over slots (zeros in empty slots), per-slot mean loss)."""
    raise NotImplementedError

  def correct(self, g: Group, evaluation: Evaluation, phase: int, stacked, broadcast, test: EvalSet, which: str
              ) -> np.ndarray:
    """Correct predictions [group size, len(evaluation.names)] of every client of the group on its test rows."""
    raise NotImplementedError

  def statistics(self, g: Group, evaluation: Evaluation, phase: int, stacked, broadcast, key: jax.Array) -> Any:
    """The evaluation's statistics (`Evaluation.statistics`) summed over the training rows of every client of the
    group, in batches of the run's batch size of each client's rows shuffled and augmented as its training batches
    (a train loader's, as HeteroFL's statistics pass), client k's from `plan.statistics_key(key, k)`."""
    raise NotImplementedError
