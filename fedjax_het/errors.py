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
