"""Orbax checkpoints of a `FederationState`, each carrying the identity of the run that wrote it.

A checkpoint holds four items: 'state' (the state's leaves), 'digests' (the SHA-256, dtype and shape of every
leaf as it was written), 'run' (a JSON dict identifying the run: the settings its numbers depend on and a
fingerprint of its partition) and 'history' (the run's metrics rows up to its round, so a resume can rebuild a
metrics.jsonl that was lost or cut short; not 'metrics', a name orbax's manager reads for its own purpose).
Restoring checks the identity first, so a checkpoint of another run (another seed, dataset or method) is refused
whatever config.json says. A checkpoint whose files are damaged is set aside and the next older one tried: one
that cannot be read (a crash mid-write, a damaged disk), and one that reads but whose leaves differ from the digests
written with them (bytes changed on disk, which orbax's reader does not notice). Only the checkpoint's own faults
set it aside: a state that cannot be placed where this run keeps it, or a run whose state has another structure,
is an error that leaves every checkpoint where it is. A save that does not land (the manager skips a step at or
below its newest, the disk is full) is an error, never ignored. Every process of a multi-process run saves and
restores (orbax writes each file once, from process 0); a sharded state comes back on the devices of the
template's sharding, a host-resident one (`--stream_clients`) as NumPy arrays on the host.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging as std_logging
import os
import re
import shutil
from typing import Any, Optional

import jax
import numpy as np
from absl import logging

from fedjax_het.engine.sharding import to_device, to_host
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


def _is_closed_loop_callback(unraisable) -> bool:
  """Whether an unraisable exception is a write of orbax's finishing after its event loop closed: tensorstore's
  callbacks of a failed save (a full disk) that land once the save has already raised."""
  return isinstance(unraisable.exc_value, RuntimeError) and 'Event loop is closed' in str(unraisable.exc_value)


@contextlib.contextmanager
def _closed_loop_callbacks_dropped(keep_after_failure: bool = True):
  """While the block runs, drops the 'Event loop is closed' errors that tensorstore's late callbacks raise when a
  save fails (orbax closes its event loop as it raises, while writes are still in flight), instead of printing a
  traceback for each: the failure is reported once, by `save`. After a failure the filter stays, as the writes
  still in flight end later."""
  import sys
  previous = sys.unraisablehook

  def hook(unraisable):
    if not _is_closed_loop_callback(unraisable):
      previous(unraisable)
  sys.unraisablehook = hook
  failed = False
  try:
    yield
  except BaseException:
    failed = True
    raise
  finally:
    if not (failed and keep_after_failure) and sys.unraisablehook is hook:
      sys.unraisablehook = previous


def _remove_settled(folder: str, quiet_seconds: float = 1.0, limit_seconds: float = 60.0) -> None:
  """Removes `folder`, a failed save's temporary folder, once the writes still in flight in tensorstore's threads
  (which go on after orbax raised) stop recreating it: removed again until it stays absent for `quiet_seconds`,
  at most `limit_seconds`."""
  import time
  deadline, absent_since = time.monotonic() + limit_seconds, None
  while time.monotonic() < deadline:
    if os.path.lexists(folder):
      shutil.rmtree(folder, ignore_errors=True)
      absent_since = None
    elif absent_since is None:
      absent_since = time.monotonic()
    elif time.monotonic() - absent_since >= quiet_seconds:
      return
    time.sleep(0.05)


def _cause(error: Exception) -> str:
  """The OS's words for why a write failed ('No space left on device'), also from orbax's tensorstore messages
  ("... [os_error_code='28']"), else the error's first line."""
  if getattr(error, 'strerror', None):
    return error.strerror
  code = re.search(r"os_error_code='(\d+)'", str(error))
  return os.strerror(int(code.group(1))) if code else str(error).splitlines()[0][:300]


class DamagedCheckpoint(Exception):
  """A checkpoint's leaves read back differently from what was written (their digests differ)."""


def leaf_digest(x: np.ndarray) -> dict:
  """The SHA-256 of a host array's bytes (C order), with its dtype and shape, as a checkpoint records them."""
  x = np.asarray(x)
  return {'sha256': hashlib.sha256(np.ascontiguousarray(x).reshape(-1).view(np.uint8)).hexdigest(),
          'dtype': str(x.dtype), 'shape': list(x.shape)}


def _placed(x: np.ndarray, leaf: Any) -> Any:
  """A restored host array placed as the template's `leaf` is: NumPy on the host for a host-resident state, back on
  its devices for a sharded one (each process keeps its own shards), else an uncommitted device array as in a
  fresh state."""
  if not isinstance(leaf, jax.Array):
    return np.array(x, dtype=np.asarray(leaf).dtype)  # writable, as the executors' host states are
  if len(leaf.sharding.device_set) > 1:
    return jax.make_array_from_callback(x.shape, leaf.sharding, lambda index: x[index])
  return to_device(x)


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
    digests = {i: leaf_digest(x) for i, x in leaves.items()}
    args = self._ocp.args.Composite(state=self._ocp.args.StandardSave(leaves),
                                    digests=self._ocp.args.JsonSave(digests),
                                    run=self._ocp.args.JsonSave(identity or {}),
                                    history=self._ocp.args.JsonSave({'rows': list(rows or [])}))
    try:
      with _orbax_thread_errors_silenced(), _closed_loop_callbacks_dropped():  # raised here, once, with its cause
        saved = self.manager.save(step, args=args)
        self.manager.wait_until_finished()
    except Exception as e:  # a full disk or a lost folder: OSError, or orbax's ValueError('RESOURCE_EXHAUSTED ...')
      _remove_settled(os.path.join(self.directory, f'{step}.orbax-checkpoint-tmp'))
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

  def digests(self, step: int) -> Optional[dict]:
    """The leaf digests saved with checkpoint `step` (`leaf_digest` by leaf index), or None when it carries none."""
    try:
      saved = self.manager.restore(step, args=self._ocp.args.Composite(digests=self._ocp.args.JsonRestore()))
    except Exception:  # a checkpoint written without the item
      return None
    return saved['digests']

  def _check_structure(self, template_leaves: list, digests: Optional[dict], step: int) -> None:
    """A CheckpointError (the checkpoint left where it is) when this run's state is not the structure the
    checkpoint holds: a reader that expects other leaves, not damage."""
    if digests is None:
      return
    expected = [(str(np.dtype(l.dtype)), list(np.shape(l))) for l in template_leaves]
    saved = [(digests[str(i)]['dtype'], digests[str(i)]['shape']) for i in range(len(digests))]
    if expected != saved:
      differ = next((i for i, (a, b) in enumerate(zip(expected, saved)) if a != b), min(len(expected), len(saved)))
      raise CheckpointError(
          f'the checkpoint of round {step} under {self.directory} holds a state of {len(saved)} arrays, and this '
          f'run\'s state has {len(expected)} (they first differ at array {differ}: '
          f'{saved[differ] if differ < len(saved) else "none"} saved, '
          f'{expected[differ] if differ < len(expected) else "none"} here), so it was not restored and is left as '
          f'it is. Fix: resume with the version of fedjax_het and the settings that wrote it.')

  def _read(self, template_leaves: list, step: int) -> list[np.ndarray]:
    """The host arrays of checkpoint `step`, checked against the digests written with them: DamagedCheckpoint on a
    difference; orbax's own errors for files it cannot read."""
    digests = self.digests(step)
    self._check_structure(template_leaves, digests, step)
    target = {str(i): np.zeros(np.shape(l), l.dtype) for i, l in enumerate(template_leaves)}
    restored = self.manager.restore(step, args=self._ocp.args.Composite(
        state=self._ocp.args.StandardRestore(target)))['state']
    arrays = [np.asarray(restored[str(i)]) for i in range(len(template_leaves))]
    if digests is None:
      logging.info('the checkpoint of round %d carries no digests; its arrays are restored unchecked.', step)
      return arrays
    damaged = [i for i, x in enumerate(arrays) if leaf_digest(x)['sha256'] != digests[str(i)]['sha256']]
    if damaged:
      raise DamagedCheckpoint(f'{len(damaged)} of its {len(arrays)} arrays differ from the digests written with '
                              f'them (array {damaged[0]} first)')
    return arrays

  def restore(self, template: Any, step: int) -> Any:
    """The state saved at `step`, checked against its digests, in the pytree structure and placement of
    `template`, a freshly initialised state (device arrays, sharded ones on the template's devices, or host
    arrays where the template holds NumPy arrays)."""
    leaves, treedef = jax.tree.flatten(template)
    arrays = self._read(leaves, step)
    return jax.tree.unflatten(treedef, [_placed(x, leaf) for x, leaf in zip(arrays, leaves)])

  def restore_latest(self, template: Any, check_identity=None) -> tuple[Any, dict]:
    """(state, identity) of the newest sound checkpoint. `check_identity(identity)` may raise to refuse it
    (another run's checkpoint); a checkpoint that cannot be read or whose arrays differ from their digests is moved
    aside with a warning and the next older one is tried. An error that is not the checkpoint's (a state structure
    or placement this run cannot take) is raised and moves nothing. A CheckpointError when none is sound."""
    leaves, treedef = jax.tree.flatten(template)
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        identity = self.identity(step)
      except Exception as e:  # orbax raises many types for damaged files; any of them means "unreadable"
        self._set_aside(step, e)
        continue
      if check_identity is not None:
        check_identity(identity)
      try:
        arrays = self._read(leaves, step)
      except CheckpointError:
        raise
      except Exception as e:  # damaged: unreadable files or arrays that differ from their digests
        self._set_aside(step, e)
        continue
      return jax.tree.unflatten(treedef, [_placed(x, leaf) for x, leaf in zip(arrays, leaves)]), identity
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
    what = 'damaged' if isinstance(error, DamagedCheckpoint) else 'unreadable'
    logging.warning('checkpoint of round %d is %s (%s); moved it to %s and trying the one before.', step, what,
                    message, target)
    self.manager = self._ocp.CheckpointManager(self.directory, options=self._options)
