"""Stop requests: Ctrl-C (SIGINT) and SIGTERM (what `timeout`, `kill` and job schedulers send) ask a run to stop
at the end of the current round, where its state can be checkpointed; a second signal aborts at once.

Rounds donate their input buffers, so a state cannot be saved from inside one, and a KeyboardInterrupt raised in
the middle of XLA's startup work (imports, compilation threads) can crash the interpreter. So the first signal
only sets a flag that the round loop reads. Entry points call `install()` before their heavy imports, so a signal
during the startup seconds is deferred too; `train_and_evaluate` installs it itself for notebook-free scripts.
Only the main thread can receive signals: elsewhere (a notebook's worker thread) this does nothing.
Pure standard library: importing it costs nothing.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_requested: Optional[str] = None  # the name of the first signal received, if any
_previous: dict = {}  # handlers that install() replaced, restored by uninstall()


def _handle(signum, frame):
  global _requested
  if _requested is not None:
    raise KeyboardInterrupt  # the second signal: abort now
  _requested = signal.Signals(signum).name
  sys.stderr.write(f'\n{_requested}: finishing this round, then checkpointing and stopping. Send it again to abort '
                   f'now (the last checkpoint then stands).\n')


def install() -> bool:
  """Routes SIGINT and SIGTERM to the stop request (idempotent); False where signals cannot be caught."""
  if threading.current_thread() is not threading.main_thread():
    return False
  for s in SIGNALS:
    current = signal.getsignal(s)
    if current is not _handle:
      _previous[s] = current
      signal.signal(s, _handle)
  return True


def uninstall() -> None:
  """Puts back the handlers `install` replaced and forgets any request."""
  global _requested
  if threading.current_thread() is threading.main_thread():
    for s, handler in _previous.items():
      signal.signal(s, handler)
  _previous.clear()
  _requested = None


def requested() -> Optional[str]:
  """'SIGINT' or 'SIGTERM' once a stop was requested, else None."""
  return _requested


class Interrupted(KeyboardInterrupt):
  """The run stopped on a signal. `resumable`: a checkpoint exists to continue from with --resume."""

  def __init__(self, signal_name: str, resumable: bool, rounds_done: int):
    super().__init__(signal_name)
    self.signal_name, self.resumable, self.rounds_done = signal_name, resumable, rounds_done


class StopAtRoundEnd:
  """Context manager around a run: stop requests are deferred to `check()` calls while it is open; on exit the
  handlers in place before are restored, unless an entry point installed them for the whole process."""

  def __init__(self):
    self._owner = False

  def __enter__(self):
    self._owner = not _previous and install()
    return self

  @property
  def requested(self) -> Optional[str]:
    return requested()

  def __exit__(self, *exc):
    if self._owner:
      uninstall()
