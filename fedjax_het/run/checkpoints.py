"""Orbax checkpoints of a `FederationState`, each carrying the identity of the run that wrote it.

A checkpoint holds three items: 'state' (the state's leaves), 'run' (a JSON dict identifying the run: the
settings its numbers depend on and a fingerprint of its partition) and 'history' (the run's metrics rows up to its
round, so a resume can rebuild a metrics.jsonl that was lost or cut short; not 'metrics', a name orbax's manager
reads for its own purpose). Restoring checks the identity first, so a
checkpoint of another run (another seed, dataset or method) is refused whatever config.json says. A checkpoint
that cannot be read (a crash mid-write, a damaged disk) is moved aside to checkpoints.unreadable/ and the next
older one is tried. A save that does not land (the manager skips a step at or below its newest, the disk is full)
is an error, never ignored. Every process of a multi-process run saves and restores (orbax writes each file once,
from process 0); a sharded state comes back on the devices of the template's sharding.
"""

from __future__ import annotations

import contextlib
import logging as std_logging
import os
import re
import shutil
from typing import Any, Optional

import jax
import numpy as np
from absl import logging

from fedjax_het.engine.sharding import to_host
from fedjax_het.errors import ConfigError
from fedjax_het.run.distributed import is_writer


class CheckpointError(ConfigError):
  """A checkpoint could not be written or read; the message names the folder and the fix."""


@contextlib.contextmanager
def _orbax_thread_errors_silenced():
  """Drops the errors orbax's writer threads log (each with a traceback) while the block runs; the failure itself
  still reaches the caller as an exception."""
  def keep(record: std_logging.LogRecord) -> bool:
    return not (record.levelno >= std_logging.ERROR and 'orbax' in record.pathname)
  logger = std_logging.getLogger('absl')
  logger.addFilter(keep)
  try:
    yield
  finally:
    logger.removeFilter(keep)


def _cause(error: Exception) -> str:
  """The OS's words for why a write failed ('No space left on device'), also from orbax's tensorstore messages
  ("... [os_error_code='28']"), else the error's first line."""
  if getattr(error, 'strerror', None):
    return error.strerror
  code = re.search(r"os_error_code='(\d+)'", str(error))
  return os.strerror(int(code.group(1))) if code else str(error).splitlines()[0][:300]


class Checkpoints:
  """The checkpoints/ folder of a run: `save(state, identity)`, `restore_latest(template)`."""

  def __init__(self, directory: str, max_to_keep: int = 2):
    import orbax.checkpoint as ocp  # Lazy: orbax is slow to import and only runs with checkpoints need it.
    self._ocp = ocp
    self.directory = os.path.abspath(directory)
    self._check_writable()
    # Synchronous saves: `save` waits for each anyway, and a failed write then raises here instead of in orbax's
    # threads (which wait minutes for a step folder that could not be made, then print their tracebacks).
    self._options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=False)
    self.manager = ocp.CheckpointManager(self.directory, options=self._options)

  def _check_writable(self) -> None:
    """A CheckpointError unless a step folder can be made in the directory (orbax's writer would wait minutes
    for one it could not make)."""
    import tempfile
    try:
      os.makedirs(self.directory, exist_ok=True)
      os.rmdir(tempfile.mkdtemp(prefix='.write_check_', dir=self.directory))
    except OSError as e:
      raise CheckpointError(f'{self.directory} cannot be written ({e.strerror or e}), so no checkpoint could be '
                            f'saved there. Fix: make it writable, or choose another --workdir.') from None

  def latest_round(self) -> Optional[int]:
    """The round of the newest checkpoint, or None."""
    return self.manager.latest_step()

  def save(self, state: Any, identity: Optional[dict] = None, rows: Optional[list] = None) -> None:
    """Saves the state under its round number with the run's `identity` and its metrics `rows` (JSON-ready
    dicts, rounds 1 to the state's), and waits until all are on disk."""
    step = int(state.round)
    leaves = {str(i): to_host(leaf) for i, leaf in enumerate(jax.tree.leaves(state))}  # gathered from every process
    args = self._ocp.args.Composite(state=self._ocp.args.StandardSave(leaves),
                                    run=self._ocp.args.JsonSave(identity or {}),
                                    history=self._ocp.args.JsonSave({'rows': list(rows or [])}))
    try:
      with _orbax_thread_errors_silenced():  # the error is raised here, once, with its cause
        saved = self.manager.save(step, args=args)
        self.manager.wait_until_finished()
    except Exception as e:  # a full disk or a lost folder: OSError, or orbax's ValueError('RESOURCE_EXHAUSTED ...')
      shutil.rmtree(os.path.join(self.directory, f'{step}.orbax-checkpoint-tmp'), ignore_errors=True)
      cause = _cause(e)
      earlier = self.latest_round()
      then = (f'continue from the checkpoint of round {earlier} with --resume' if earlier is not None else
              f'start the run again (no earlier checkpoint exists) in a new --workdir, or after deleting '
              f'{os.path.dirname(self.directory)}')
      raise CheckpointError(f'the checkpoint of round {step} could not be written under {self.directory} '
                            f'({cause}). Fix the cause (free disk space), then {then}.') from None
    if not saved:
      raise CheckpointError(f'the checkpoint of round {step} was not written: {self.directory} already holds one '
                            f'at round {self.latest_round()}, which belongs to another run. Fix: use a new '
                            f'--workdir.')

  def identity(self, step: int) -> dict:
    """The run identity saved with checkpoint `step`."""
    return self.manager.restore(step, args=self._ocp.args.Composite(run=self._ocp.args.JsonRestore()))['run']

  def metrics(self, step: int) -> Optional[list]:
    """The metrics rows saved with checkpoint `step`, or None when it carries none."""
    try:
      saved = self.manager.restore(step, args=self._ocp.args.Composite(history=self._ocp.args.JsonRestore()))
    except Exception:  # a checkpoint written without the item: orbax raises several types
      return None
    return saved['history']['rows']

  def restore(self, template: Any, step: int) -> Any:
    """The state saved at `step`, in the pytree structure and device placement (sharding) of `template`, a
    freshly initialised state."""
    leaves, treedef = jax.tree.flatten(template)
    target = {str(i): np.zeros(np.shape(l), l.dtype) for i, l in enumerate(leaves)}
    restored = self.manager.restore(step, args=self._ocp.args.Composite(
        state=self._ocp.args.StandardRestore(target)))['state']
    # Sharded leaves go back to their devices (each process keeps its own shards); single-device ones stay
    # uncommitted, as in a fresh state.
    place = lambda x, leaf: (jax.make_array_from_callback(x.shape, leaf.sharding, lambda index: x[index])
                             if len(leaf.sharding.device_set) > 1 else jax.numpy.asarray(x))
    return jax.tree.unflatten(treedef, [place(restored[str(i)], leaf) for i, leaf in enumerate(leaves)])

  def restore_latest(self, template: Any, check_identity=None) -> tuple[Any, dict]:
    """(state, identity) of the newest readable checkpoint. `check_identity(identity)` may raise to refuse it
    (another run's checkpoint); an unreadable checkpoint is moved aside with a warning and the next older one is
    tried. A CheckpointError when none is readable."""
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        identity = self.identity(step)
      except Exception as e:  # orbax raises many types for damaged files; any of them means "unreadable"
        self._set_aside(step, e)
        continue
      if check_identity is not None:
        check_identity(identity)
      try:
        return self.restore(template, step), identity
      except Exception as e:
        self._set_aside(step, e)
    raise CheckpointError(f'--resume: no readable checkpoint under {self.directory}. Fix: drop --resume and start '
                          f'the run again in a new --workdir.')

  def _set_aside(self, step: int, error: Exception) -> None:
    if not is_writer():  # the other processes of a multi-process run skip it; process 0 moves it
      return
    aside = os.path.join(os.path.dirname(self.directory), 'checkpoints.unreadable')
    os.makedirs(aside, exist_ok=True)
    target = os.path.join(aside, str(step))
    shutil.rmtree(target, ignore_errors=True)
    shutil.move(os.path.join(self.directory, str(step)), target)
    message = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
    logging.warning('checkpoint of round %d is unreadable (%s); moved it to %s and trying the one before.', step,
                    message, target)
    self.manager = self._ocp.CheckpointManager(self.directory, options=self._options)
