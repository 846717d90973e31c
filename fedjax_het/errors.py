"""User-facing errors: one clear message naming the flag/argument and the fix."""


class ConfigError(ValueError):
  """A flag or argument the user set cannot work; the message names it and says how to fix it."""


class DatasetUnavailableError(ConfigError):
  """A dataset is not prepared on this machine and cannot be fetched offline."""


def setting(record, field: str) -> str:
  """'Class.field=value', one field of a config record as an error message names it (the command line shows
  '--flag=value' instead, `naming_flags`)."""
  return f'{type(record).__name__}.{field}={getattr(record, field)!r}'


def naming_flags(error: ConfigError, flags: dict[str, str]) -> ConfigError:
  """`error` (same class) with each library argument it names, a key of `flags` such as 'LocalTraining.epochs',
  replaced by its command-line flag ('--local_epochs'); a key 'Class.*' maps each 'Class.field' to '--field'.
  Keys apply in order (specific ones first). Library callers see argument names, the command line its flags."""
  import re
  message = str(error)
  for name, flag in flags.items():
    if name.endswith('.*'):
      message = re.sub(re.escape(name[:-1]) + r'(\w+)', r'--\1', message)
    else:
      message = re.sub(re.escape(name) + r'(?!\w)', flag, message)
  return type(error)(message)


# The exit status of every command (experiments/*.py, python -m fedjax_het.flower.local, python -m
# fedjax_het.data.prepare, python -m fedjax_het.run.launch); docs/reliability.md#exit-statuses.
EXIT_FAILED = 1  # the work started and failed: a download, a process, the Flower run, an unexpected error
EXIT_USAGE = 2  # the command line cannot work as given: a flag, value or name that does not exist, a refused
                # setting (a ConfigError), a dataset that is not there; no round was trained
# 130 / 143: stopped by SIGINT / SIGTERM after a clean stop (a checkpoint stands where one was written).


def closest(name: str, names, n: int = 3) -> list[str]:
  """The entries of `names` closest to `name` (a misspelling's candidates), best first; none when nothing is close."""
  import difflib
  names = list(names)
  found = difflib.get_close_matches(name, names, n, cutoff=0.6)
  return found or [m for m in names if name and (m.startswith(name) or name in m)][:n]


def did_you_mean(name: str, names, prefix: str = '') -> str:
  """' (did you mean a or b?)' for the entries of `names` closest to `name`, each after `prefix`; '' for none."""
  found = [prefix + m for m in closest(name, names)]
  if not found:
    return ''
  return f' (did you mean {", ".join(found[:-1]) + " or " if len(found) > 1 else ""}{found[-1]}?)'


# What to do, derived from an error message that does not say it: (pattern, the fix from its match).
_FIXES = (
    (r'(--\w+)=\S+ must be >= (-?\d+(?:\.\d+)?(?:e[+-]?\d+)?)', lambda m: f'{m[1]}={m[2]} or more.'),
    (r'(--\w+)=\S+ must be > (-?\d+(?:\.\d+)?(?:e[+-]?\d+)?)', lambda m: f'a value of {m[1]} above {m[2]}.'),
    (r'(--\w+)=\S+ must be (?:in|between) ', lambda m: f'a value of {m[1]} in that range.'),
    (r'(--\w+)=\S+ must be a finite', lambda m: f'a finite number for {m[1]}.'),
    (r'(--\w+)\S*[ :].*(?:unknown|choose one of|choose from)', lambda m: f'one of the names listed for {m[1]}.'),
    (r'(--\w+)', lambda m: f'change {m[1]} as this line says (--help describes it).'),
)


def with_fix(message: str) -> str:
  """`message` on one line, ending with 'Fix: ...': its own where it has one, else one derived from what it says
  (`--x=-1 must be >= 0.` gets `Fix: --x=0 or more.`)."""
  import re
  message = ' '.join(line.strip() for line in str(message).strip().splitlines())
  if 'Fix:' in message:
    return message
  for pattern, fix in _FIXES:
    m = re.search(pattern, message)
    if m:
      return f'{message.rstrip()}{"" if message.rstrip().endswith(".") else "."} Fix: {fix(m)}'
  return f'{message.rstrip().rstrip(".")}. Fix: change what this line names.'


def error_line(error) -> str:
  """The one line every command prints for an error: 'error: WHAT. Fix: HOW.'"""
  return 'error: ' + with_fix(str(error))


def argument_parser(**kwargs):
  """An `argparse.ArgumentParser` whose errors are a ConfigError in the library's voice (argparse prints its usage
  and 'prog: error: ...' and exits 2): an unknown option with the closest ones, a bad value naming its option."""
  import argparse
  import re

  class Parser(argparse.ArgumentParser):

    def error(self, message):
      options = [o for action in self._actions for o in action.option_strings if o.startswith('--')]
      m = re.match(r'unrecognized arguments: (.*)', message)
      if m:
        given = m[1].split()[0]
        name = given.split('=', 1)[0]
        near = closest(name, options)
        raise ConfigError(f'{name} is not an option of {self.prog}{did_you_mean(name, options)}. Fix: '
                          f'{near[0] + ", if that is the one meant; " if near else ""}{self.prog} --help lists its '
                          f'options.')
      m = re.match(r'argument (\S+): (.*)', message)
      if m:
        raise ConfigError(f'{m[1]}: {m[2].rstrip(".")}. Fix: {self.prog} --help describes {m[1]}.')
      raise ConfigError(message if 'Fix:' in message else f'{message.rstrip(".")}. Fix: {self.prog} --help.')

  return Parser(**kwargs)
