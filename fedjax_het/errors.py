"""User-facing errors: one clear message naming the flag/argument and the fix."""


class ConfigError(ValueError):
  """A flag or argument the user set cannot work; the message names it and says how to fix it."""


class DatasetUnavailableError(ConfigError):
  """A dataset is not prepared on this machine and cannot be fetched offline."""
