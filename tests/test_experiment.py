import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from fedjax_het.errors import ConfigError
from fedjax_het.run.config import ExperimentConfig
from fedjax_het.run.experiment import train_and_evaluate

from runs import CFG, metric_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tensorboard_scalars(folder) -> dict:
  """{(tag, step): value} of every scalar in the TensorBoard event files under `folder`, read record by record
  (TFRecord framing: length, its CRC, the serialised Event, its CRC) with tensorboardX's Event message."""
  import struct
  from tensorboardX.proto import event_pb2
  out = {}
  for name in sorted(os.listdir(folder)):
    with open(os.path.join(folder, name), 'rb') as f:
      data = f.read()
    at = 0
    while at < len(data):
      (length,) = struct.unpack('<Q', data[at:at + 8])
      event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
      at += 12 + length + 4
      for value in event.summary.value:
        out[(value.tag, event.step)] = value.simple_value
  return out


def test_tensorboard_without_its_package_is_one_clear_error(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, 'tensorboardX', None)  # as if not installed
  with pytest.raises(ConfigError, match=r"--tensorboard needs tensorboardX.*pip install 'fedjax_het\[tensorboard\]'"):
    train_and_evaluate(CFG, str(tmp_path / 'run'), progress=False, tensorboard=True)
  assert not os.path.exists(tmp_path / 'run')  # refused before anything is written


def test_a_file_where_the_tensorboard_folder_goes_is_one_clear_error_before_any_output(tmp_path):
  (tmp_path / 'run').mkdir()
  (tmp_path / 'run' / 'tensorboard').write_text('not a folder')
  with pytest.raises(ConfigError, match=r'^--tensorboard: .*tensorboard exists and is not a folder.*Fix: move'):
    train_and_evaluate(CFG, str(tmp_path / 'run'), progress=False, tensorboard=True)
  assert sorted(p.name for p in (tmp_path / 'run').iterdir() if p.name != '.lock') == ['tensorboard']


def test_outputs_are_written(tmp_path, capsys):
  summary = train_and_evaluate(CFG, str(tmp_path), progress=True, tensorboard=True)
  # the start says what the run executes with (the backend's defaults where no flag is set)
  assert f'{CFG.algorithm}: running on cpu (' in capsys.readouterr().err
  for name in ('metrics.jsonl', 'summary.json', 'accuracy.png', 'config.json', 'partition.json', 'partition.png'):
    assert os.path.exists(tmp_path / name), name
  rows = metric_rows(tmp_path)
  scalars = tensorboard_scalars(tmp_path / 'tensorboard')  # every number of every round, as metrics.jsonl has it
  for row in rows:
    for key, value in row.items():
      if key != 'round' and isinstance(value, (int, float)) and not isinstance(value, bool):
        assert scalars[(key, row['round'])] == pytest.approx(value, rel=1e-6), key
  assert {step for _, step in scalars} == {1, 2, 3, 4}
  assert [r['round'] for r in rows] == [1, 2, 3, 4]
  for key in ('accuracy', 'client_accuracy_mean', 'client_accuracy_std', 'train_loss', 'upload_scalars',
              'broadcast_scalars'):
    assert key in rows[-1]
  assert summary['final_accuracy'] == rows[-1]['accuracy']
  assert summary['best_accuracy'] == max(r['accuracy'] for r in rows)
  assert summary['upload_scalars_per_round'] == 2 * (16 + 10)  # 2 participants x (d + C)
  assert summary['config']['models'] == ['mlp', 'small_cnn_narrow']
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['2', '4']


@pytest.mark.slow
def test_resume_continues_to_the_same_numbers(tmp_path):
  full, part = str(tmp_path / 'full'), str(tmp_path / 'part')
  train_and_evaluate(CFG, full, progress=False)
  train_and_evaluate(dataclasses.replace(CFG, rounds=3), part, progress=False)
  shutil.rmtree(os.path.join(part, 'checkpoints', '3'))  # as if the run died after logging round 3
  train_and_evaluate(CFG, part, resume=True, progress=False)
  assert metric_rows(part) == metric_rows(full)


def test_a_second_run_into_a_used_workdir_is_refused_and_leaves_it_untouched(tmp_path):
  train_and_evaluate(dataclasses.replace(CFG, rounds=1), str(tmp_path), progress=False)
  before = {name: open(os.path.join(tmp_path, name)).read() for name in ('metrics.jsonl', 'summary.json',
                                                                         'config.json')}
  with pytest.raises(ConfigError, match='already holds a run'):
    train_and_evaluate(dataclasses.replace(CFG, rounds=1, seed=1), str(tmp_path), progress=False)
  assert {name: open(os.path.join(tmp_path, name)).read() for name in before} == before


def test_resume_refuses_changed_settings_and_missing_checkpoints(tmp_path):
  train_and_evaluate(dataclasses.replace(CFG, rounds=2), str(tmp_path), progress=False)
  with pytest.raises(ConfigError, match='different settings for alpha'):
    train_and_evaluate(dataclasses.replace(CFG, alpha=0.9), str(tmp_path), resume=True, progress=False)
  with pytest.raises(ConfigError, match='no checkpoint'):
    train_and_evaluate(CFG, str(tmp_path / 'fresh'), resume=True, progress=False)


@pytest.mark.parametrize('flags,message', [
    ('--dataset=imagenet-9000', '--dataset'),
    ('--models=cnn4,vgg99', "--models: unknown model 'vgg99'"),
    ('--algorithm=fedsomething', '--algorithm'),
    ('--re=xyz', "--re='xyz' is unknown"),
    ('--alpha=0', '--alpha'),
    ('--num_clients=1000', '--num_clients'),
    ('--flagfile=/no/such/file.flags', 'no/such/file.flags'),
    ('--lamda=-1 --algorithm=fedproto', '--lamda=-1.0 must be >= 0'),            # a method config's check
    ('--sub_feature_dim=64 --feature_dim=32 --algorithm=fedmrl',                   # a method factory's check
     '--sub_feature_dim=64 must be <= --feature_dim=32'),
    ('--global_model=vgg99 --algorithm=fml', "--global_model='vgg99' is not a registered model"),
    ('--algorithm=fedvtc --rm=ap', "Fix: --rm='fc' (now 'ap')"),                  # a check at the groups' init
    ('--num_devices=99', 'Fix: --num_devices between 1 and'),
])
def test_cli_bad_input_gives_one_clear_error(tmp_path, flags, message):
  """In process: the flags of experiments/fedre.py, parsed and run as its main does; library checks name the
  flags, not the library's argument names."""
  said = cli_error(tmp_path, flags)
  assert message in said
  assert 'Config.' not in said


def cli_error(tmp_path, flags: str) -> str:
  """The ConfigError message of experiments/fedre.py's flags (digits, one round of mlp) plus `flags`, in process."""
  from absl import flags as absl_flags
  from fedjax_het.run import cli
  fv = absl_flags.FlagValues()
  cli.define_flags(flag_values=fv)
  args = ['prog', '--dataset=digits', '--rounds=1', '--models=mlp', f'--workdir={tmp_path}', '--progress=false']
  with pytest.raises(ConfigError) as error:
    cli.parse_flags(args + flags.split(), fv)
    cli.run(fv)
  return str(error.value)


def test_a_memory_budget_that_no_call_fits_is_refused_in_gib_before_anything_compiles(tmp_path, monkeypatch):
  """nan and inf were tracebacks; 1e-9 GiB (1 byte) was refused only after the first round compiled, as
  '--memory_budget=1 bytes'. Now a value that is not a finite number of GiB fails as the config is made, and a
  budget below what every vmapped call of a group holds (its client states and rows) fails before anything
  compiles, naming --memory_budget_gib in GiB; the executor's own refusal, after XLA's analysis, names it so too."""
  from fedjax_het.engine.federation import Federation
  from fedjax_het.errors import naming_flags
  from fedjax_het.run.config import flags_of_arguments
  monkeypatch.setattr(Federation, 'init', lambda self: pytest.fail('compiled before the budget was checked'))
  for value in ('nan', 'inf'):
    assert re.match(rf'--memory_budget_gib={value} must be a finite number of GiB\. Fix: .*--memory_budget_gib=40',
                    cli_error(tmp_path, f'--memory_budget_gib={value} --strategy=vmap'))
  for extra in ('', ' --stream_clients'):
    message = cli_error(tmp_path, '--memory_budget_gib=1e-9 --strategy=vmap' + extra)
    assert re.match(r"--memory_budget_gib=1e-09 \(1 bytes\) is less than what every vmapped call of group 'mlp' "
                    r'holds on the device: .* GiB before any activation\. Fix: a --memory_budget_gib well above ',
                    message), message
    assert ('--stream_clients' in message) == (not extra)  # streaming is the way out of a resident population
  assert os.listdir(tmp_path) == ['.lock']
  late = ConfigError("ExecutionConfig.memory_budget=0.001 GiB (1073741 bytes): a round of group 'mlp' needs 0.002 GiB "
                     '(2147483 bytes) on the device with 1 client(s) per call. Fix: a larger '
                     'ExecutionConfig.memory_budget, or fewer clients or a smaller model in that group.')
  named = str(naming_flags(late, flags_of_arguments()))
  assert named.startswith('--memory_budget_gib=0.001 GiB (1073741 bytes): ') and '--memory_budget=' not in named
  assert 'Fix: a larger --memory_budget_gib,' in named


def test_the_entry_point_exits_with_the_error_and_no_traceback(tmp_path):
  args = [sys.executable, os.path.join(ROOT, 'experiments', 'fedre.py'), '--dataset=digits', '--rounds=1',
          '--models=mlp', f'--workdir={tmp_path}', '--progress=false', '--re=xyz']
  result = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert result.returncode != 0
  assert '--re' in result.stderr and 'Traceback' not in result.stderr


def test_method_flags_are_derived_from_the_config_dataclasses_and_ignored_ones_are_named():
  from absl import flags
  from fedjax_het.run import cli
  from fedjax_het.methods import FDConfig, FedProtoConfig
  fv = flags.FlagValues()
  cli.define_flags(flag_values=fv)
  cli.parse_flags(['prog', '--algorithm=fedproto', '--lamda=3', '--fml_alpha=0.25', '--workdir=/tmp/x'], fv)
  cfg = cli.config_from_flags(fv)
  assert cfg.method_config == FedProtoConfig(lamda=3.0)
  assert cfg.methods['fd'] == FDConfig(lamda=3.0) and cfg.methods['fml'].alpha == 0.25
  assert cli.ignored_method_flags(fv, ['fedproto']) == ['fml_alpha']
  assert cli.ignored_method_flags(fv, ['fedproto', 'fml']) == []
  assert 'lamda' in fv.module_help('fedjax_het.run.registry (shared)')
  assert 'fml_alpha' in fv.module_help('fedjax_het.run.registry.fml')
  with pytest.raises(ConfigError, match='unknown methods'):
    ExperimentConfig(methods={'fedsomething': FDConfig()})


def test_every_run_setting_is_one_field_with_its_flag():
  """A flag of the run's settings is defined from its ExperimentConfig field: the default, the choices and the help
  are the field's."""
  import dataclasses
  from absl import flags
  from fedjax_het.run import cli
  fv = flags.FlagValues()
  cli.define_flags(flag_values=fv)
  fields = {f.name: f for f in dataclasses.fields(ExperimentConfig) if f.name != 'methods'}
  for name in ('dataset', 'rm', 'conv', 'dp_parts', 'batch_size', 'drop_last'):
    field = fields[name]
    default = list(field.default) if isinstance(field.default, tuple) else field.default
    assert fv[name].default == default and fv[name].help.endswith(field.metadata['help'])
  assert fv['rm'].parser.enum_values == ['ap', 'mp', 'fc', 'none']
  assert 'onednn' in fv['conv'].parser.enum_values
  assert 'list' in fv['dp_parts'].parser.flag_type()
  assert set(fields) <= set(fv)


def test_the_settings_a_resume_may_change_are_the_ones_that_change_no_number():
  from fedjax_het.run.config import resumable_settings
  assert set(resumable_settings()) == {
      'rounds', 'checkpoint_every', 'data_dir', 'strategy', 'chunk_size', 'conv', 'scan_unroll', 'num_devices',
      'client_threads', 'onednn_threads', 'group_threads', 'scan_blocks', 'eval_batch_size', 'memory_budget_gib',
      'stream_clients'}


def test_a_config_builds_and_checks_each_record_once(monkeypatch):
  from fedjax_het.engine import execution
  built = []
  original = execution.ExecutionConfig.__post_init__
  monkeypatch.setattr(execution.ExecutionConfig, '__post_init__', lambda self: (built.append(1), original(self)))
  cfg = ExperimentConfig(dataset='digits', models=('mlp',), strategy='sequential', conv='xla')
  first = cfg.execution_config()
  calls = len(built)
  assert cfg.execution_config() is first and len(built) == calls
  assert cfg.local_training() is cfg.local_training() and cfg.model_config() is cfg.model_config()


def test_a_sweeps_unknown_method_is_named_by_its_own_flag(tmp_path):
  """experiments/compare.py's --algorithms is checked by the comparison, once, and named as --algorithms."""
  args = [sys.executable, os.path.join(ROOT, 'experiments', 'compare.py'), '--dataset=digits', '--rounds=1',
          '--models=mlp', f'--workdir={tmp_path}', '--algorithms=fedre,fedsomething', '--seeds=0']
  result = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert result.returncode != 0 and 'Traceback' not in result.stderr
  assert "--algorithms: unknown or empty ['fedsomething']" in result.stderr
  assert '--algorithm=' not in result.stderr


def test_readme_notebook_snippet_runs():
  with open(os.path.join(ROOT, 'README.md')) as f:
    readme = f.read()
  snippet = readme.split('```python\n', 1)[1].split('```', 1)[0]
  namespace = {}
  exec(compile(snippet, 'README.md', 'exec'), namespace)
  assert namespace['metrics']['accuracy'] > 0.3


@pytest.mark.parametrize('flagfile', sorted(os.listdir(os.path.join(ROOT, 'experiments', 'flags'))))
def test_every_flag_file_parses_into_a_config(flagfile):
  from absl import flags
  from fedjax_het.run import cli
  fv = flags.FlagValues()
  cli.define_flags(flag_values=fv)
  fv(['prog', f'--flagfile={os.path.join(ROOT, "experiments", "flags", flagfile)}', '--workdir=/tmp/x'])
  cfg = cli.config_from_flags(fv)
  # Felo's settings and its baselines'
  felo = flagfile.startswith(('felo_table', 'fedmd_felo', 'heterofl_felo', 'fedgkt_felo'))
  twenty = flagfile.startswith('fedvtc_mnist5k') or (felo and 'cifar10' in flagfile)
  assert cfg.rounds > 0 and cfg.num_clients == (100 if flagfile.startswith('fedvtc_table1') else 20 if twenty else 10)
  if felo:  # one library round per code iteration: 100 paper-rounds of K x 0.2 (x 1.0); FedMD's transfer round
    assert cfg.rounds == 100 * round(cfg.num_clients * cfg.join_ratio) + (cfg.algorithm == 'fedmd')
    if cfg.algorithm == 'fedgkt':  # FedGKT's code (FedML's loaders): CIFAR-10's true std, CINIC-10's statistics
      assert cfg.input_normalization == ('cifar10_fedml' if 'cifar10' in flagfile else 'cinic10_fedml')
    else:
      assert cfg.input_normalization == ('cifar10' if 'cifar10' in flagfile else 'symmetric')  # the code's CIFAR-10
  if flagfile.startswith('gefl'):  # GeFL's loaders keep the last partial batch; its CNNs end in one fc
    assert not cfg.drop_last and cfg.rm == 'none'
    if cfg.algorithm in ('gefl', 'gefl_f'):
      assert cfg.methods[cfg.algorithm].mode == ('update' if 'table2' in flagfile and 'dcgan' in flagfile
                                                 else 'freeze')
  # every method flag the file sets is its method's, or one of a method its comments name (a shared file)
  with open(os.path.join(ROOT, 'experiments', 'flags', flagfile)) as f:
    comments = ' '.join(line for line in f if line.startswith('#'))
  foreign = [flag for flag in cli.ignored_method_flags(fv, [cfg.algorithm]) if flag.split('_')[0] not in comments]
  assert not foreign, foreign
  if flagfile.endswith('_feddf.flags'):  # FedDF's code's distillation schedule and early stopping (its README)
    feddf = cfg.methods['feddf']
    assert (feddf.server_steps, feddf.patience, feddf.eval_every) == (10000, 1000, 100)
    # the code's CIFAR loaders crop and flip the public batches
    assert feddf.public_augment == ('crop_flip' if cfg.public_dataset.startswith('cifar') else 'none')
    assert cfg.server_validation_size == {'mnist': 600, 'fashion_mnist': 600, 'cifar10': 2500}[cfg.dataset]
  if flagfile.startswith('heterofl_felo'):  # Felo: "the default settings in the source code of HeteroFL"
    heterofl = cfg.methods['heterofl']
    assert cfg.augment == 'crop_flip' and heterofl.clip_norm == 1.0 and heterofl.lr_decay == 0.1
    assert heterofl.milestones == (int(0.375 * cfg.rounds), int(0.625 * cfg.rounds))  # its 150, 250 of 400
    assert cfg.models == ('preact_resnet26@1',) and heterofl.split == 'dynamic'  # Felo runs the dynamic split
    assert heterofl.rates == (1, 0.5, 0.25, 0.125, 0.0625)  # HeteroFL's a-e
  if flagfile.startswith('fedvtc_table1'):  # the scaling under which the paper's rates train
    assert cfg.methods['fedvtc'].loss_reduction == 'mean'
    assert cfg.methods['fedtype'].backward == 'none'  # FedType as its released code runs it, as FedVTC's authors
    assert cfg.methods['fedtype'].proxy_model == 'resnet18_cifar'  # its code's proxy: the 3x3-stem ResNet-18


def test_a_diverged_dp_run_names_the_noise_before_the_learning_rate():
  import types
  from fedjax_het.run.experiment import diverged_message
  cfg = dataclasses.replace(CFG, dp_mode='central', dp_noise_multiplier=1000.0, dp_clip=5.0)
  message = diverged_message(cfg, 2, float('nan'), types.SimpleNamespace(noise_multiplier=1000.0))
  assert message.startswith('training diverged in round 3 (train_loss=nan). Under --dp_mode=central the noise on '
                            'what the server averages has standard deviation sigma * C = 1000 * 5 = 5000 per '
                            'coordinate. Fix: less noise (a larger --dp_target_epsilon or a smaller '
                            '--dp_noise_multiplier), a smaller --dp_clip (now 5)')
  assert '--local_learning_rate' in message.split('or else')[1]
  assert diverged_message(CFG, 0, float('inf')).startswith('training diverged in round 1 (train_loss=inf). Fix: a '
                                                           'lower --local_learning_rate')


def test_architecture_that_cannot_take_the_images_fails_clearly():
  with pytest.raises(ConfigError, match="--models: architecture 'cnn4' cannot take images of shape"):
    train_and_evaluate(dataclasses.replace(CFG, models=('cnn4',)), '/tmp/never_written', progress=False)


def test_divergence_stops_with_a_clear_error_and_keeps_outputs(tmp_path):
  from fedjax_het.run.experiment import TrainingDiverged
  with pytest.raises(TrainingDiverged, match='--local_learning_rate'):
    train_and_evaluate(dataclasses.replace(CFG, local_learning_rate=1e9), str(tmp_path), progress=False)
  assert os.path.exists(tmp_path / 'summary.json') and metric_rows(tmp_path)


def test_interrupt_keeps_a_resumable_checkpoint(tmp_path, monkeypatch):
  from fedjax_het.engine.federation import Federation
  original = Federation.evaluate
  calls = []

  def interrupt_in_third_eval(self, state):
    calls.append(1)
    if len(calls) == 3:
      os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C during round 3
    return original(self, state)

  monkeypatch.setattr(Federation, 'evaluate', interrupt_in_third_eval)
  cfg = dataclasses.replace(CFG, checkpoint_every=100)
  with pytest.raises(KeyboardInterrupt):
    train_and_evaluate(cfg, str(tmp_path / 'run'), progress=False)
  monkeypatch.setattr(Federation, 'evaluate', original)
  assert sorted(os.listdir(tmp_path / 'run' / 'checkpoints')) == ['3']  # round 3 finished, then stopped
  assert json.load(open(tmp_path / 'run' / 'summary.json'))['rounds'] == 3
  train_and_evaluate(cfg, str(tmp_path / 'run'), resume=True, progress=False)
  train_and_evaluate(cfg, str(tmp_path / 'full'), progress=False)
  assert metric_rows(tmp_path / 'run') == metric_rows(tmp_path / 'full')


def test_tfds_path_end_to_end_with_mock_data(tmp_path):
  import tensorflow_datasets as tfds
  cfg = dataclasses.replace(CFG, dataset='mnist', models=('cnn4',), eval_protocol='global', train_fraction=0.75,
                            rounds=1, num_clients=2, join_ratio=1.0, checkpoint_every=0)
  with tfds.testing.mock_data(num_examples=64):
    summary = train_and_evaluate(cfg, str(tmp_path), progress=False)
  row = metric_rows(tmp_path)[-1]
  assert 0.0 <= summary['final_accuracy'] <= 1.0 and 'local_test_accuracy' in row


def test_run_py_names_the_algorithm_flag_on_bad_input(tmp_path):
  args = [sys.executable, os.path.join(ROOT, 'experiments', 'run.py'), '--algorithm=fedsomething',
          '--dataset=digits', '--rounds=1', f'--workdir={tmp_path}', '--progress=false']
  result = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert result.returncode != 0 and '--algorithm' in result.stderr and 'fedproto' in result.stderr
  assert 'Traceback' not in result.stderr


def test_comparison_table_shows_each_phases_accuracy_for_methods_of_several_phases():
  from fedjax_het.run.compare import MethodResult, comparison_table

  def summary(by_phase):
    return {'final_accuracy': 0.5, 'best_accuracy': 0.5, 'upload_scalars_per_round': 1,
            'broadcast_scalars_per_round': 1, 'final_accuracy_by_phase': by_phase}
  two_phase = MethodResult('fedvtc', [summary({'fl': 0.1, 'finetune': 0.3}), summary({'fl': 0.2, 'finetune': 0.5})],
                           [])
  table = comparison_table([MethodResult('fedproto', [summary({'train': 0.5})], []), two_phase])
  assert '| fedvtc | fl 15.00 +- 5.00; finetune 40.00 +- 10.00 |' in table
  assert '| fedproto | fl' not in table and 'fedproto | train' not in table


# Slow (`-m slow`, five runs: about 10 s of a 2-core CPU); the default run reuses a finished run in
# tests/test_entry_points.py.
@pytest.mark.slow
def test_comparison_runs_every_method_and_seed_then_reuses_finished_runs(tmp_path):
  from fedjax_het.run.compare import comparison_table, run_comparison, write_comparison
  cfg = dataclasses.replace(CFG, rounds=2, checkpoint_every=0)
  results = run_comparison(cfg, ['fedre', 'fedproto'], [0, 1], str(tmp_path), progress=False, tensorboard=True)
  assert [r.algorithm for r in results] == ['fedre', 'fedproto']
  for method in ('fedre', 'fedproto'):  # one TensorBoard run per method and seed, overlaid under --logdir
    for seed in (0, 1):
      accuracy = [r['accuracy'] for r in metric_rows(tmp_path / method / f'seed{seed}')]
      scalars = tensorboard_scalars(tmp_path / method / f'seed{seed}' / 'tensorboard')
      assert [scalars[('accuracy', step)] for step in (1, 2)] == pytest.approx(accuracy, rel=1e-6)
  finals = [s['final_accuracy'] for s in results[1].summaries]
  finals_fedre = [s['final_accuracy'] for s in results[0].summaries]
  assert [c[0] for c in results[1].curves] == [[1, 2], [1, 2]]
  table = write_comparison(results, str(tmp_path), 'test')
  mean, std = 100 * sum(finals) / 2, 100 * abs(finals[0] - finals[1]) / 2
  assert f'| fedproto | {mean:.2f} +- {std:.2f} |' in table
  for name in ('comparison.md', 'comparison.json', 'comparison.png'):
    assert os.path.exists(tmp_path / name)
  stamp = os.path.getmtime(tmp_path / 'fedre' / 'seed1' / 'metrics.jsonl')
  again = run_comparison(cfg, ['fedre', 'fedproto'], [0, 1], str(tmp_path), progress=False)
  assert os.path.getmtime(tmp_path / 'fedre' / 'seed1' / 'metrics.jsonl') == stamp  # reused, not rerun
  assert comparison_table(again) == comparison_table(results)
  # Executed otherwise (threads, strategy): the same numbers, reused. Other settings, no checkpoint to continue
  # from: refused, the finished run left as it was.
  threaded = run_comparison(dataclasses.replace(cfg, client_threads=1, group_threads=1), ['fedre'], [1],
                            str(tmp_path), progress=False)
  assert os.path.getmtime(tmp_path / 'fedre' / 'seed1' / 'metrics.jsonl') == stamp
  assert threaded[0].summaries[0] == results[0].summaries[1]
  with pytest.raises(ConfigError, match=r"^--workdir: .*seed1 holds a run with other settings \(local_learning_rate: "
                                        r"0\.05 there, 0\.03 now\), and no checkpoint .* Fix: a new --workdir"):
    run_comparison(dataclasses.replace(cfg, local_learning_rate=0.03), ['fedre'], [1], str(tmp_path), progress=False)
  assert os.path.getmtime(tmp_path / 'fedre' / 'seed1' / 'metrics.jsonl') == stamp
  assert json.load(open(tmp_path / 'fedre' / 'seed1' / 'summary.json'))['final_accuracy'] == finals_fedre[1]
  with pytest.raises(ConfigError, match='--algorithms'):
    run_comparison(cfg, ['fedre', 'nope'], [0], str(tmp_path), progress=False)
  # Printing a finished comparison again where its folder cannot be written: the table, and one warning.
  import builtins
  real_open = builtins.open

  def read_only(path, mode='r', *a, **k):
    if any(c in mode for c in 'wax+'):
      raise OSError(30, 'Read-only file system')
    return real_open(path, mode, *a, **k)
  os.remove(tmp_path / 'comparison.md')
  from unittest import mock
  with mock.patch('builtins.open', read_only):
    assert write_comparison(again, str(tmp_path), 'test') == comparison_table(results)
  assert not os.path.exists(tmp_path / 'comparison.md')


def test_a_run_that_diverges_is_recorded_and_the_comparison_goes_on(tmp_path, monkeypatch):
  """A diverged run is an outcome (e.g. a method under strong DP noise): its summary says the round, the table
  counts it, the other runs go on, and running the comparison again reuses it."""
  from fedjax_het.run import compare
  cfg = dataclasses.replace(CFG, rounds=3, checkpoint_every=0)
  results = compare.run_comparison(cfg, ['fedre[server_learning_rate=1e30]', 'local'], [0], str(tmp_path),
                                   progress=False)
  broken = results[0].summaries[0]
  assert broken['diverged_round'] == 2 and not broken['finished'] and results[1].summaries[0]['finished']
  assert '| 1 (1 diverged) |' in compare.comparison_table(results)
  monkeypatch.setattr(compare, 'train_and_evaluate', lambda *a, **k: pytest.fail('a kept outcome was run again'))
  assert compare.run_comparison(cfg, ['fedre[server_learning_rate=1e30]'], [0], str(tmp_path),
                                progress=False)[0].summaries[0]['diverged_round'] == 2


def test_accuracy_plot_draws_one_line_per_architecture(tmp_path, monkeypatch):
  from fedjax_het.run import plots
  import matplotlib.axes
  drawn = []
  original = matplotlib.axes.Axes.plot
  monkeypatch.setattr(matplotlib.axes.Axes, 'plot', lambda self, *a, **k: drawn.append(k.get('label')) or
                      original(self, *a, **k))
  rows = [{'round': 1, 'phase': 'p', 'accuracy': 0.5, 'eval_head': 'group_model', 'client_accuracy': [0.2, 0.8, 0.4]}]
  plots.plot_accuracy(rows, str(tmp_path / 'a.png'), 't', ['cnn', 'mlp', 'cnn'])
  assert drawn == ['group_model', 'cnn', 'mlp'] and (tmp_path / 'a.png').stat().st_size > 0


def test_sample_grid_puts_each_classs_real_images_left_of_its_generated_ones():
  import numpy as np
  from fedjax_het.run.plots import sample_canvas
  real = np.stack([np.full((1, 2, 2, 1), -1.0), np.full((1, 2, 2, 1), 0.0)])        # classes 0, 1: one each
  generated = np.stack([np.full((2, 2, 2, 1), 1.0), np.full((2, 2, 2, 1), -0.5)])  # two each
  canvas = sample_canvas(generated, real)[..., 0]
  assert canvas.shape == (2 * 3, 1 * 3 + 2 + 2 * 3)  # rows: 2 classes x (2 + 1); columns: 3, a gap of 2, 6
  np.testing.assert_allclose(canvas[0:2, 0:2], 0.0)    # class 0's real image (-1 -> 0)
  np.testing.assert_allclose(canvas[3:5, 0:2], 0.5)    # class 1's real image (0 -> 0.5)
  np.testing.assert_allclose(canvas[0:2, 5:7], 1.0)    # class 0's first generated image
  np.testing.assert_allclose(canvas[3:5, 8:10], 0.25)  # class 1's second generated image (-0.5 -> 0.25)
  np.testing.assert_allclose(canvas[:, 3:5], 1.0)      # separator column and the gap are white


def test_a_setting_error_names_the_argument_in_the_library_and_the_flag_on_the_command_line():
  from fedjax_het.run.config import flags_named, flags_of_arguments
  from fedjax_het.errors import naming_flags
  from fedjax_het.run.experiment import build_federation
  from fedjax_het.local_training import LocalTraining
  with pytest.raises(ConfigError, match=r'^LocalTraining\.epochs=-1 must be >= 0'):
    LocalTraining(epochs=-1)
  with pytest.raises(ConfigError, match=r'^--local_epochs=-1 must be >= 0'):
    with flags_named():
      LocalTraining(epochs=-1)
  with pytest.raises(ConfigError, match=r'^--join_ratio=0\.0 must be in \(0, 1\]'):  # raised by Federation
    build_federation(dataclasses.replace(CFG, join_ratio=0.0))
  message = naming_flags(ConfigError("ModelConfig.rm='none': widths differ. Fix: ModelConfig.rm='ap' with one "
                                     "ModelConfig.feature_dim, or LocalTraining.drop_last=False."), flags_of_arguments())
  assert str(message) == "--rm='none': widths differ. Fix: --rm='ap' with one --feature_dim, or --nodrop_last."
  # an argument that one setting sets is named by that setting's flag (its `setting(argument=...)`)
  assert str(naming_flags(ConfigError('DPConfig.clip=0 and DPConfig.clip_parts=x'), flags_of_arguments())) == \
      '--dp_clip=0 and --dp_clip_parts=x'
