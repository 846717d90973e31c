"""absl flags shared by the entry points in experiments/, and their mapping to `ExperimentConfig`."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Optional, Sequence

from absl import app, flags, logging

from fedjax_het.run.compilation_cache import DEFAULT_DIRECTORY, use_compilation_cache
from fedjax_het.run.config import SETTING_GROUPS, ExperimentConfig, flags_named
from fedjax_het.run.registry import METHODS, config_with, hyperparameter_flags

# The groups of the experiment flags, in the order --help lists them (absl's --helpfull lists them as modules).
FLAG_GROUPS = SETTING_GROUPS


def _group_module(group: str) -> str:
  """The absl module name under which the flags of `group` are registered."""
  return f'fedjax_het ({group})'


class _Definer:
  """absl's DEFINE_* functions bound to one FlagValues (the global FLAGS, or a fresh one in tests) and, when
  `group` is given, registered under that group of FLAG_GROUPS."""

  def __init__(self, flag_values, group: Optional[str] = None):
    self._fv = flag_values
    self._group = group

  def group(self, group: str) -> '_Definer':
    """The same definer, defining flags of `group`."""
    assert group in FLAG_GROUPS, group
    return _Definer(self._fv, group)

  def __getattr__(self, name):
    define = getattr(flags, name)
    extra = {'module_name': _group_module(self._group)} if self._group else {}
    return lambda *args, **kw: define(*args, flag_values=self._fv, **{**extra, **kw})


def define_flags(default_algorithm: str = 'fedre', flag_values=None) -> None:
  """Defines every experiment flag on `flag_values` (default: absl's global FLAGS); idempotent. The run's settings
  come from `ExperimentConfig`'s fields (`config.setting`: default, group, help, choices), the method
  hyperparameters from the registered config dataclasses; the rest say where a run writes and how it starts."""
  flag_values = flags.FLAGS if flag_values is None else flag_values
  if 'algorithm' in flag_values:
    return
  f = _Definer(flag_values)
  for field in dataclasses.fields(ExperimentConfig):
    if field.name != 'methods':
      define_setting_flag(f, field, default_algorithm)
  f = f.group('output')
  f.DEFINE_string('workdir', None, 'Output folder: metrics.jsonl, summary.json, accuracy.png, checkpoints/.')
  f.DEFINE_bool('resume', False, 'Continue from the last checkpoint in --workdir.')
  f.DEFINE_bool('progress', True, 'Say what the start does and show each round: on a terminal a bar with the current '
                'accuracy, where stderr is a file a line per round.')
  f.DEFINE_bool('tensorboard', False, 'Also write each round\'s scalars as TensorBoard events in '
                'WORKDIR/tensorboard (needs tensorboardX: pip install \'fedjax_het[tensorboard]\').')
  f = f.group('execution')
  f.DEFINE_bool('distributed', False, 'Join the run\'s other processes first (jax.distributed.initialize; every '
                'process with the same flags; python -m fedjax_het.run.launch starts them on one machine).')
  f.DEFINE_string('compilation_cache', DEFAULT_DIRECTORY, 'Folder of XLA\'s persistent compilation cache: '
                  'programs compiled once (by another architecture, seed or run) are read back, not compiled again; '
                  'results are unchanged. Empty: off. JAX_COMPILATION_CACHE_DIR, when set, takes precedence.')
  define_method_flags(f)


def define_setting_flag(f: '_Definer', field: dataclasses.Field, default_algorithm: str) -> None:
  """The flag of one `ExperimentConfig` field: its name, its default, its group and help (`config.setting`); an
  enum where it has choices, a list for a tuple, else of the field's type."""
  meta = field.metadata
  f = f.group(meta['group'])
  default, help_ = field.default, meta['help']
  if field.name == 'algorithm':
    default = default_algorithm
    help_ = 'The method: ' + '; '.join(f'{name} ({m.summary})' for name, m in METHODS.items()) + '.'
  kind = _flag_type(field) if not str(field.type).startswith('tuple') else 'list'
  if meta['choices'] is not None:
    f.DEFINE_enum(field.name, default, list(meta['choices']), help_)
  elif kind == 'list':
    f.DEFINE_list(field.name, list(default), help_)
  else:
    define = {'float': f.DEFINE_float, 'int': f.DEFINE_integer, 'bool': f.DEFINE_bool, 'str': f.DEFINE_string}
    define[kind](field.name, default, help_)


def _flag_type(field: dataclasses.Field) -> str:
  """'float', 'int', 'bool' or 'str' of a hyperparameter field (Optional[...] unwrapped)."""
  name = field.type if isinstance(field.type, str) else getattr(field.type, '__name__', str(field.type))
  name = name.replace('Optional[', '').rstrip(']')
  if name not in ('float', 'int', 'bool', 'str'):
    raise TypeError(f'hyperparameter {field.name}: unsupported type {field.type!r} for a flag')
  return name


def define_method_flags(f: '_Definer') -> None:
  """One flag per method hyperparameter (`methods.hyperparameter_flags`), derived from the config dataclasses:
  default None (each method's own default applies), help listing every method's default; a flag of one method
  is listed under that method in --helpfull, a shared one under 'fedjax_het.run.registry (shared)'."""
  define = {'float': f.DEFINE_float, 'int': f.DEFINE_integer, 'bool': f.DEFINE_bool, 'str': f.DEFINE_string}
  for flag, uses in hyperparameter_flags().items():
    types = {_flag_type(field) for _, field in uses}
    if len(types) != 1:
      raise TypeError(f'--{flag} is shared by fields of different types: {uses}')
    defaults = ', '.join(f'{name} {field.default if field.default is not None else "the local setting"}'
                         for name, field in uses)
    module = f'fedjax_het.run.registry.{uses[0][0]}' if len(uses) == 1 else 'fedjax_het.run.registry (shared)'
    define[types.pop()](flag, None, f'{uses[0][1].metadata.get("help", "")} Default: {defaults}.',
                        module_name=module)


def method_values(fv) -> dict:
  """flag -> value of every method hyperparameter flag that was given."""
  return {flag: fv[flag].value for flag in hyperparameter_flags() if fv[flag].value is not None}


def ignored_method_flags(fv, algorithms) -> list[str]:
  """The method flags given that none of `algorithms` reads."""
  uses = hyperparameter_flags()
  return [flag for flag in method_values(fv) if not any(name in algorithms for name, _ in uses[flag])]


def config_from_flags(fv=None, algorithms=None, **overrides) -> ExperimentConfig:
  """The `ExperimentConfig` of the parsed flags, with `overrides` (config fields) in place of theirs; every
  method's hyperparameters take the method flags given.

  Method flags that none of `algorithms` (default: --algorithm) reads are reported with a warning (a flag file
  shared by several methods may set hyperparameters of others)."""
  fv = fv or flags.FLAGS
  values = method_values(fv)
  general = {field.name: getattr(fv, field.name) for field in dataclasses.fields(ExperimentConfig)
             if field.name not in ('methods', 'models') and field.name in fv}
  general.update(overrides)
  with flags_named():  # a method config's check names its flag; the config checks --algorithm
    config = ExperimentConfig(**general, models=tuple(fv.models),
                              methods={name: config_with(name, values) for name in METHODS})
    from fedjax_het.models.registry import assign_models
    assign_models(config.models, 1)  # an unknown model's name, before any data is loaded
  algorithms = algorithms or [config.algorithm]  # a sweep's own names are its to check (`compare.run_comparison`)
  ignored = ignored_method_flags(fv, algorithms)
  if ignored:
    uses = hyperparameter_flags()
    logging.warning('%s', '; '.join(f'--{flag} is ignored by {", ".join(algorithms)} (it is a hyperparameter of '
                                    f'{", ".join(n for n, _ in uses[flag])})' for flag in ignored))
  return config


HELP_ARGS = ('-h', '--help', '-?', '--helpshort')


def _flag_lines(flag) -> list[str]:
  """One flag as --help shows it: its name, then its help and default, wrapped."""
  import textwrap
  text = flag.help
  if flag.default is not None:
    text += f' (default: {flag.default_as_str})'
  elif 'Default:' not in text:
    text += ' (default: none)'
  return [f'  --{"[no]" if isinstance(flag, flags.BooleanFlag) else ""}{flag.name}'] + textwrap.wrap(
      text, 110, initial_indent='      ', subsequent_indent='      ')


def _method_flags(fv, algorithm: Optional[str]) -> list:
  """The hyperparameter flags that `algorithm` reads (none when no method is named)."""
  if not algorithm or algorithm not in METHODS:
    return []
  return [fv[flag] for flag, uses in hyperparameter_flags().items()
          if flag in fv and any(name == algorithm for name, _ in uses)]


def help_text(fv, usage: str, argv: Sequence[str] = ()) -> str:
  """What `--help` prints for an entry point: `usage`, the flags its own script defines, then the experiment
  flags (where it defines them) by group (data, models, training, method, execution, differential privacy,
  output); the method group holds the hyperparameters of the method named by --algorithm in `argv` (or the entry
  point's default). Flags of other modules (absl's, JAX's) are left to --helpfull."""
  algorithm = fv['algorithm'].default if 'algorithm' in fv else None  # no method flags: the script's own only
  for arg in argv:
    if arg.startswith('--algorithm='):
      algorithm = arg.split('=', 1)[1]
  lines = [usage.strip(), '']
  own = fv.get_flags_for_module(sys.argv[0])  # flags the entry point's script defines itself
  if own:
    lines.append('This command:')
    for flag in own:
      lines += _flag_lines(flag)
    lines.append('')
  by_module = fv.flags_by_module_dict()
  for group in FLAG_GROUPS:
    group_flags = list(by_module.get(_group_module(group), []))
    if group == 'method':
      group_flags += _method_flags(fv, algorithm)
    if not group_flags:
      continue
    title = f'{group} ({algorithm})' if group == 'method' and algorithm else group
    lines.append(title[0].upper() + title[1:] + ':')
    for flag in group_flags:
      lines += _flag_lines(flag)
    if group == 'method' and not _method_flags(fv, algorithm):
      lines.append('  (give --algorithm=NAME with --help to list that method\'s hyperparameters)')
    lines.append('')
  if 'algorithm' in fv:
    lines.append('--flagfile=FILE reads flags from FILE; flags given after it override the file\'s. '
                 '--helpfull lists every flag, each method\'s hyperparameters under its name.')
  return '\n'.join(lines)


def app_run(main, usage: Optional[str] = None) -> None:
  """absl's `app.run(main)` in the library's voice: -h / --help / --helpshort print this entry point's own flags on
  stdout and exit 0 (absl prints the flags of the main module and exits 1); a bad flag, value or name, whether the
  flags' parser or `main` finds it, prints one line, `error: WHAT. Fix: HOW.`, and exits with `EXIT_USAGE` (absl:
  'FATAL Flags parsing error' and 1). `usage`: the text above the flags (default: the __main__ module's
  docstring)."""
  argv = sys.argv[1:]
  if any(arg in HELP_ARGS for arg in argv):
    usage = usage if usage is not None else (sys.modules['__main__'].__doc__ or '')
    fv = flags.FLAGS
    print(help_text(fv, usage, argv))
    sys.exit(0)
  app.run(lambda rest: call_main(main, rest, flags.FLAGS),
          flags_parser=lambda args: parse_flags_or_exit(args, flags.FLAGS))


def exit_with_error(error, status: Optional[int] = None, distributed: bool = False) -> None:
  """Exits with `status` (default `EXIT_USAGE`) after the one line of `error` on stderr (`errors.error_line`); in a
  run of several processes without JAX's shutdown, which waits minutes for processes that may never get there."""
  from fedjax_het.errors import EXIT_USAGE, error_line
  status = EXIT_USAGE if status is None else status
  if distributed:
    from fedjax_het.run import interrupts
    interrupts.exit_now(error_line(error), status)
  sys.stderr.write(error_line(error) + '\n')
  sys.stderr.flush()
  sys.exit(status)


def flag_error(error: 'flags.Error', fv) -> 'ConfigError':
  """absl's error for a command line, as the library says it: the flag named as given, the closest flags of a
  misspelt one, and the fix."""
  import re
  from fedjax_het.errors import ConfigError, closest, did_you_mean
  message = str(error).strip()
  if isinstance(error, flags.UnrecognizedFlagError):
    name = error.flagname
    given = (error.flagvalue or f'--{name}').split('=', 1)[0]
    names = [n for n in fv if not n.startswith('help')]
    negated = name[2:] if name.startswith('no') and name[2:] in fv else None
    if negated:  # --nofoo of a flag that is not boolean
      return ConfigError(f'{given}: --{negated} is not a yes/no flag. Fix: --{negated}=VALUE (--help describes it).')
    close = closest(name, names)
    fix = f'--{close[0]}, if that is the one meant; ' if close else ''
    return ConfigError(f'{given} is not a flag of this command{did_you_mean(name, names, "--")}. Fix: {fix}--help '
                       f'lists this command\'s flags, --helpfull every flag.')
  if isinstance(error, flags.CantOpenFlagFileError):
    reason = re.sub(r'^(ERROR:+\s*)', '', message).rstrip('.')
    return ConfigError(f'--flagfile: {reason}. Fix: the path of a flag file (the project\'s are in experiments/flags/).')
  m = re.match(r'flag --(\w+)=(.*?): (.*)$', message, re.S)
  if m and m[1] in fv:
    name, value, reason = m[1], m[2], m[3].rstrip('.')
    flag = fv[name]
    if 'must have a value other than None' in reason:
      return ConfigError(f'--{name} is required. Fix: --{name}=VALUE ({flag.help.rstrip(".")}).')
    kind = flag.flag_type()
    if kind in ('int', 'float') and re.search(r'invalid literal|could not convert', reason):
      reason = 'not an integer' if kind == 'int' else 'not a number'
    choices = getattr(flag.parser, 'enum_values', None)
    if choices:
      reason = 'not one of its values'
    takes = ('one of ' + ', '.join(choices) if choices else
             {'int': 'an integer', 'float': 'a number', 'bool': f'true or false (or --{name}, --no{name})',
              'list': 'a comma-separated list'}.get(kind, 'a value as --help describes it'))
    return ConfigError(f'--{name}={value}: {reason}. Fix: --{name} takes {takes}.')
  return ConfigError(message)


def parse_flags(argv: list[str], fv) -> list[str]:
  """Parses argv (program name first) into `fv`; returns the arguments left over (the program name first). A bad
  flag, value or flag file is one ConfigError naming it (`flag_error`)."""
  try:
    return fv(argv)
  except flags.Error as e:
    raise flag_error(e, fv) from None


def parse_flags_or_exit(argv: list[str], fv) -> list[str]:
  """`parse_flags`, a bad command line exiting with its one error line (`exit_with_error`)."""
  from fedjax_het.errors import ConfigError
  try:
    return parse_flags(argv, fv)
  except ConfigError as e:
    exit_with_error(e)


def call_main(main, argv: Sequence[str], fv) -> None:
  """`main(argv)`, a ConfigError or absl's UsageError it raises leaving as one error line (`exit_with_error`)."""
  from fedjax_het.errors import ConfigError
  distributed = 'distributed' in fv and fv.is_parsed() and fv['distributed'].value
  try:
    main(argv)
  except ConfigError as e:
    exit_with_error(e, distributed=distributed)
  except app.UsageError as e:
    exit_with_error(f'{str(e).rstrip(".")}. Fix: give every setting as --flag=value (--help lists them).',
                    distributed=distributed)


def command(main, argv: Sequence[str], fv) -> int:
  """An entry point's command line `argv` (program name first) in process, as `app_run` runs it less absl's
  setup: parsed into `fv`, then `main(rest)`; returns the exit status (a bad input: `EXIT_USAGE`, its line on
  stderr)."""
  try:
    call_main(main, parse_flags_or_exit(list(argv), fv), fv)
  except SystemExit as e:
    if e.code is None or isinstance(e.code, int):
      return e.code or 0
    sys.stderr.write(f'{e.code}\n')
    return 1
  return 0


def run(fv) -> dict:
  """Parsed flags -> `train_and_evaluate` -> the summary (no process exit: `main` and tests call it)."""
  from fedjax_het.run.experiment import train_and_evaluate
  from fedjax_het.run import distributed
  if fv.distributed:
    distributed.initialize()  # before any computation
  use_compilation_cache(fv.compilation_cache)
  cfg = config_from_flags(fv)
  with flags_named():  # an error raised while the run builds or traces names the flags, not library arguments
    return train_and_evaluate(cfg, fv.workdir, resume=fv.resume, progress=fv.progress and distributed.is_writer(),
                              tensorboard=fv.tensorboard)


def _exit_interrupted(e, workdir: str) -> None:
  """Exits with the status of the signal (130 SIGINT, 143 SIGTERM) and says what was kept and how to go on."""
  if e.resumable:
    message = (f'stopped ({e.signal_name}) after round {e.rounds_done}: outputs and a checkpoint are in {workdir}; '
               f'continue with the same flags plus --resume.')
  elif e.rounds_done == 0:
    message = f'stopped ({e.signal_name}) before the first round; nothing was saved: run the same command again.'
  else:
    message = (f'stopped ({e.signal_name}) after {e.rounds_done} rounds, before any checkpoint: nothing to resume. '
               f'Start again without --resume (in a new --workdir, or after deleting {workdir}).')
  sys.stderr.write(message + '\n')
  sys.exit(143 if e.signal_name == 'SIGTERM' else 130)


def main(argv, fv=None) -> None:
  """The body of the experiment entry points: parsed flags (default: absl's FLAGS) -> `train_and_evaluate`, the
  summary printed as JSON.

  A `ConfigError` (bad input) exits with its one line, `error: ... Fix: ...`, and `EXIT_USAGE`; an interrupt exits
  saying how to resume."""
  from fedjax_het.errors import ConfigError
  from fedjax_het.run import interrupts
  from fedjax_het.run.interrupts import Interrupted
  fv = fv or flags.FLAGS
  if len(argv) > 1:
    raise ConfigError(f'unexpected arguments {argv[1:]}. Fix: give every setting as --flag=value (--help lists them).')
  if 'verbosity' not in fv or not fv['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO.
  try:
    summary = run(fv)
  except ConfigError as e:
    exit_with_error(e, distributed=fv.distributed)
  except Interrupted as e:
    _exit_interrupted(e, fv.workdir)
  except KeyboardInterrupt:  # a second signal: aborted mid-round
    interrupts.exit_now(f'aborted: the last checkpoint in {fv.workdir} stands; continue from it with the same flags '
                        f'plus --resume (a run aborted before its first checkpoint starts again without --resume).',
                        interrupts.exit_code())
  from fedjax_het.run import distributed
  if distributed.is_writer():
    print(json.dumps({k: v for k, v in summary.items() if k != 'config'}, indent=2))
