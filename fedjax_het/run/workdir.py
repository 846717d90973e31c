"""A run's output folder: its layout, an exclusive lock while a run uses it, and crash-safe metrics and JSON files.

Layout: config.json, partition.json and partition.png (class counts per client), metrics.jsonl (one line per
round), summary.json, accuracy.png, checkpoints/ (`fedjax_het.run.checkpoints`), .lock (held by the running process).

One run per workdir: a second run into a folder that holds one is refused unless it resumes, and two processes
never write one folder at once (an advisory `flock` on .lock, released by the kernel however the holder dies, so
kill -9 leaves no stale lock). JSON files are written to a temporary name and renamed, so a crash leaves the old
file or the new one, never half of one; metrics.jsonl is appended line by line, and a torn last line (a crash
mid-write) is dropped when it is read back.

In a run of several processes (`fedjax_het.run.distributed`) only process 0 writes: the others open the folder with
`writes=False`, which makes the same checks, takes no lock and writes nothing.
"""

from __future__ import annotations

import json
import math
import os
from typing import IO, Any, Callable, Optional

from absl import logging

from fedjax_het.errors import ConfigError

try:
  import fcntl
except ImportError:  # not POSIX: no lock, everything else works
  fcntl = None


def write_atomically(path: str, write: Callable[[IO], None], binary: bool = False, mode: int = 0o666) -> None:
  """Calls write(f) on a temporary file beside `path` (created with permissions `mode`, less the umask), then
  renames it to `path`: a crash leaves the old file or the new one, never half of one."""
  fd = os.open(path + '.tmp', os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
  with os.fdopen(fd, 'wb' if binary else 'w', newline=None if binary else '') as f:
    write(f)
  os.replace(path + '.tmp', path)


def strict_json(obj: Any, indent: Optional[int] = None) -> str:
  """`obj` as standard JSON: a NaN or infinite number (which Python's json writes as NaN / Infinity, which other
  readers refuse) becomes null, and in a dict the key `<key>_not_finite` beside it says which it was ('nan',
  'inf', '-inf')."""
  def clean(value):
    if isinstance(value, float) and not math.isfinite(value):
      return None
    if isinstance(value, dict):
      out = {}
      for k, v in value.items():
        out[k] = clean(v)
        if isinstance(v, float) and not math.isfinite(v):
          out[f'{k}_not_finite'] = 'nan' if math.isnan(v) else ('inf' if v > 0 else '-inf')
      return out
    if isinstance(value, (list, tuple)):
      return [clean(v) for v in value]
    return value
  return json.dumps(clean(obj), indent=indent, allow_nan=False)


class Workdir:
  """The folder of one run. `open(resume)` validates and locks it; `close()` releases the lock. With `writes`
  False (the processes of a multi-process run but the first) it reads and checks, and every write is skipped."""

  def __init__(self, path: Optional[str], writes: bool = True):
    if not path:
      raise ConfigError('--workdir is required: the folder for metrics.jsonl, summary.json and checkpoints/.')
    self.path, self.writes = path, writes
    self._lock = None

  def file(self, name: str) -> str:
    return os.path.join(self.path, name)

  @property
  def checkpoints(self) -> str:
    return self.file('checkpoints')

  def has_checkpoints(self) -> bool:
    """Whether checkpoints/ exists and holds anything."""
    return os.path.isdir(self.checkpoints) and bool(os.listdir(self.checkpoints))

  def holds_run(self) -> bool:
    """Whether the folder holds the outputs of a run: a metrics.jsonl or a non-empty checkpoints/ folder."""
    return os.path.exists(self.file('metrics.jsonl')) or self.has_checkpoints()

  def open(self, resume: bool) -> 'Workdir':
    """Creates the folder if needed, checks it is writable, takes the lock and refuses a used folder without
    `resume`; every failure is one ConfigError naming --workdir."""
    if os.path.exists(self.path) and not os.path.isdir(self.path):
      raise ConfigError(f'--workdir={self.path} is a file, not a folder. Fix: choose a folder path.')
    if os.path.islink(self.path) and not os.path.exists(self.path):
      raise ConfigError(f'--workdir={self.path} is a symbolic link to {os.readlink(self.path)}, which does not '
                        f'exist. Fix: create that folder, or point --workdir at an existing one.')
    if not self.writes:
      self._refuse_used(resume)
      return self
    try:
      os.makedirs(self.path, exist_ok=True)
      self._lock = open(self.file('.lock'), 'a+')
    except OSError as e:
      raise ConfigError(f'--workdir={self.path} cannot be written ({e.strerror or e}). Fix: choose a folder you '
                        f'can write to.') from None
    if fcntl is not None:
      try:
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError:
        self._lock.seek(0)
        holder = self._lock.read().strip() or 'another process'
        self._lock.close()
        self._lock = None
        raise ConfigError(f'--workdir={self.path} is in use by a running run (pid {holder}). Fix: wait for it to '
                          f'finish or stop it, or choose another --workdir.') from None
      self._lock.seek(0)
      self._lock.truncate()
      self._lock.write(str(os.getpid()))
      self._lock.flush()
    try:
      self._refuse_used(resume)
    except ConfigError:
      self.close()
      raise
    return self

  def _refuse_used(self, resume: bool) -> None:
    if not resume and self.holds_run():
      raise ConfigError(f'--workdir={self.path} already holds a run (metrics.jsonl or checkpoints/); starting '
                        f'another there would overwrite its outputs. Fix: add --resume to continue that run, or '
                        f'choose a new --workdir.')

  def close(self) -> None:
    """Releases the lock."""
    if self._lock is not None:
      self._lock.close()
      self._lock = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # ---------------------------------------------------------------- files
  def write_json(self, name: str, obj: Any) -> None:
    """Writes `name` atomically (temporary file, then rename)."""
    if not self.writes:
      return
    write_atomically(self.file(name), lambda f: f.write(strict_json(obj, indent=2)))

  def read_json(self, name: str) -> Optional[Any]:
    """The parsed file, or None when it is missing or unreadable (a note is logged for the latter)."""
    path = self.file(name)
    if not os.path.exists(path):
      return None
    try:
      with open(path) as f:
        return json.load(f)
    except (OSError, ValueError) as e:
      logging.warning('%s is unreadable (%s); ignoring it.', path, e)
      return None

  def read_metrics(self, upto_round: int) -> list[dict]:
    """The rows of metrics.jsonl up to `upto_round`. A torn last line (a crash while appending) is dropped; a bad
    line elsewhere is an error naming it."""
    path = self.file('metrics.jsonl')
    if not os.path.exists(path):
      return []
    with open(path) as f:
      lines = [line for line in f.read().split('\n') if line.strip()]
    rows = []
    for i, line in enumerate(lines):
      try:
        rows.append(json.loads(line))
      except ValueError:
        if i == len(lines) - 1:
          logging.warning('%s: dropping its torn last line (the run stopped while writing it).', path)
          continue
        raise ConfigError(f'{path}: line {i + 1} is not JSON, so the rounds logged cannot be read back. Fix: '
                          f'repair or delete that line, then --resume again.') from None
    return [r for r in rows if r.get('round', 0) <= upto_round]

  def write_metrics(self, rows: list[dict]) -> None:
    """Replaces metrics.jsonl by `rows` atomically."""
    if not self.writes:
      return
    write_atomically(self.file('metrics.jsonl'), lambda f: f.writelines(strict_json(r) + '\n' for r in rows))

  def append_metrics(self, row: dict) -> None:
    """Appends one round's row to metrics.jsonl and flushes it to the OS."""
    if not self.writes:
      return
    with open(self.file('metrics.jsonl'), 'a') as f:
      f.write(strict_json(row) + '\n')
