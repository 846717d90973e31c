"""Stop requests: Ctrl-C (SIGINT) and SIGTERM (what `timeout`, `kill` and job schedulers send) ask a run to stop
at the end of the current round, where its state can be checkpointed; a second signal aborts at once.

Rounds donate their input buffers, so a state cannot be saved from inside one, and a KeyboardInterrupt raised in
the middle of XLA's startup work (imports, compilation threads) can crash the interpreter. So the first signal
only sets a flag that the round loop reads. Entry points call `install()` before their heavy imports, so a signal
during the startup seconds is deferred too; `train_and_evaluate` installs it itself for notebook-free scripts.
Only the main thread can receive signals: elsewhere (a notebook's worker thread) this does nothing.

Python runs a signal handler only when the main thread next executes Python, which it does not while it waits
inside XLA (a large program compiling can hold it for minutes). Entry points therefore also start a watcher thread
(`install(watch=True)`): it learns of each signal at once, through `signal.set_wakeup_fd`, says so, and on the
second signal ends the process itself (exit 130 / 143) when the main thread has not reacted within
`ABORT_GRACE_SECONDS`. Checkpoints are written atomically, so the last one stands. Notebooks never get the watcher:
there a second signal raises KeyboardInterrupt, as it always did.
Pure standard library: importing it costs nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM)
ABORT_GRACE_SECONDS = 2.0  # how long the watcher waits for the main thread before it ends the process itself
_abort_message = ('aborted ({signal}): the last checkpoint stands; continue from it with the same flags plus '
                  '--resume (a run aborted before its first checkpoint starts again without --resume).')
_requested: Optional[str] = None  # the name of the first signal received, if any
_handled = 0  # signals the main thread's handler has seen
_aborting = threading.Event()  # the main thread is raising KeyboardInterrupt for a second signal
_lock = threading.Lock()
_previous: dict = {}  # handlers that install() replaced, restored by uninstall()
_watcher: Optional[tuple] = None  # (read fd, write fd, previous wakeup fd) while the watcher thread runs


def _request(signal_name: str) -> None:
  """Records the first stop request and says what will happen (once, whichever thread sees it first)."""
  global _requested
  with _lock:
    if _requested is not None:
      return
    _requested = signal_name
  sys.stderr.write(f'\n{signal_name}: finishing this round, then checkpointing and stopping. Send it again to abort '
                   f'now (the last checkpoint then stands).\n')
  sys.stderr.flush()


def _handle(signum, frame):
  global _handled
  _handled += 1
  if _handled > 1:
    _aborting.set()
    raise KeyboardInterrupt  # the second signal: abort now
  _request(signal.Signals(signum).name)


def _watch(read_fd: int) -> None:
  """The watcher thread: each SIGINT / SIGTERM byte from the wakeup fd as it arrives."""
  seen = 0
  while True:
    try:
      data = os.read(read_fd, 64)
    except OSError:
      data = b''
    if not data:  # uninstall() closed the pipe
      os.close(read_fd)
      return
    for signum in data:
      if signum not in SIGNALS:
        continue
      seen += 1
      name = signal.Signals(signum).name
      if seen == 1:
        _request(name)
      elif not _aborting.wait(ABORT_GRACE_SECONDS):  # the main thread is inside XLA and cannot raise
        exit_now(_abort_message.format(signal=name), 128 + signum)


def exit_now(message: str, code: int) -> None:
  """Writes `message` to stderr and ends the process at once with `code`, without the interpreter's shutdown
  (which waits for XLA's compile threads: minutes while a large program compiles)."""
  sys.stdout.flush()
  sys.stderr.write('\n' + message + '\n')
  sys.stderr.flush()
  os._exit(code)


def exit_code() -> int:
  """The exit status of a run stopped by the requested signal: 143 for SIGTERM, else 130."""
  return 143 if _requested == 'SIGTERM' else 130


def install(watch: bool = False, abort_message: Optional[str] = None) -> bool:
  """Routes SIGINT and SIGTERM to the stop request (idempotent); False where signals cannot be caught. `watch`
  (entry points only) also starts the watcher thread that aborts a process whose main thread cannot react, with
  `abort_message` ('{signal}' is filled in) instead of the default one."""
  global _watcher, _abort_message
  if threading.current_thread() is not threading.main_thread():
    return False
  if abort_message is not None:
    _abort_message = abort_message
  for s in SIGNALS:
    current = signal.getsignal(s)
    if current is not _handle:
      _previous[s] = current
      signal.signal(s, _handle)
  if watch and _watcher is None:
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    _watcher = (read_fd, write_fd, previous)
    threading.Thread(target=_watch, args=(read_fd,), name='fedjax_het-signal-watcher', daemon=True).start()
  return True


def uninstall() -> None:
  """Puts back the handlers (and wakeup fd) `install` replaced, stops the watcher and forgets any request."""
  global _requested, _handled, _watcher
  if threading.current_thread() is threading.main_thread():
    for s, handler in _previous.items():
      signal.signal(s, handler)
    if _watcher is not None:
      read_fd, write_fd, previous = _watcher
      signal.set_wakeup_fd(previous)
      os.close(write_fd)  # the watcher's read returns b'' and it ends
      _watcher = None
  _previous.clear()
  _requested, _handled = None, 0
  _aborting.clear()


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
