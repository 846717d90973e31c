"""Every name a benchmark or experiment script imports from fedjax_het exists (the scripts are not run by the
suite, so a renamed function would otherwise break them unnoticed)."""

import ast
import importlib
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(os.path.join(folder, name) for folder in ('benchmarks', 'experiments')
                 for name in os.listdir(os.path.join(ROOT, folder)) if name.endswith('.py'))


def missing_imports(source: str) -> list[str]:
  """'module.name' for each `from fedjax_het... import name` in source that names neither an attribute nor a
  submodule of its module."""
  missing = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split('.')[0] == 'fedjax_het':
      module = importlib.import_module(node.module)
      for alias in node.names:
        if not hasattr(module, alias.name):
          try:
            importlib.import_module(f'{node.module}.{alias.name}')
          except ModuleNotFoundError:
            missing.append(f'{node.module}.{alias.name}')
  return missing


def test_a_missing_name_is_found():
  missing = missing_imports('from fedjax_het.methods.shared.common import descend, no_such_thing\n'
                            'from fedjax_het.engine import vmap_executor')
  assert missing == ['fedjax_het.methods.shared.common.no_such_thing']


@pytest.mark.parametrize('script', SCRIPTS)
def test_the_scripts_fedjax_het_imports_exist(script):
  with open(os.path.join(ROOT, script)) as f:
    assert missing_imports(f.read()) == [], script


RUNNERS = ['experiments/compare.py', 'experiments/fedre.py', 'experiments/fedvtc.py', 'experiments/felo.py',
           'experiments/gefl.py', 'experiments/run.py']


@pytest.mark.parametrize('script', RUNNERS)
def test_each_runners_help_says_what_it_runs_and_which_flag_file_to_start_from(script):
  """--help prints the module docstring: its first line says what the script runs, and it names an existing flag
  file to start from."""
  import re
  with open(os.path.join(ROOT, script)) as f:
    doc = ast.get_docstring(ast.parse(f.read()))
  assert doc and doc.splitlines()[0].endswith('.') and len(doc.splitlines()[0]) <= 120, script
  files = re.findall(r'--flagfile=(\S+\.flags)', doc)
  assert files and all(os.path.exists(os.path.join(ROOT, path)) for path in files), (script, files)


def defined_flags(source: str) -> list[str]:
  """The flags a script defines itself: the names of its absl DEFINE_* calls and argparse '--' options."""
  names = []
  for node in ast.walk(ast.parse(source)):
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
      continue
    if node.func.attr.startswith('DEFINE_'):
      names.append(node.args[0].value)
    elif node.func.attr == 'add_argument' and node.args[0].value.startswith('--'):
      names.append(node.args[0].value[2:])
  return names


def test_a_scripts_own_flags_are_found():
  source = ("flags.DEFINE_string('out', None, 'x')\nparser.add_argument('--num_processes', type=int)\n"
            "parser.add_argument('command')\n")
  assert defined_flags(source) == ['out', 'num_processes']


EXPERIMENT_GROUPS = ('Data:', 'Models:', 'Training:', 'Method', 'Execution:', 'Differential privacy:', 'Output:')
ENTRY_POINTS = [os.path.join('experiments', name) for name in sorted(os.listdir(os.path.join(ROOT, 'experiments')))
                if name.endswith('.py')] + ['fedjax_het/run/launch.py', 'fedjax_het/flower/local.py',
                                            'fedjax_het/data/prepare.py']


# Each call starts an interpreter that imports JAX (about 2 s): the default run checks the generic runner, the
# paper's main script and the entry points outside experiments/; the other experiment scripts, which define their
# flags with the same `cli.define_flags` and whose imports test_the_scripts_fedjax_het_imports_exist checks, in the
# slow set (`-m slow`).
DEFAULT_HELP = ('experiments/run.py', 'experiments/fedre.py')


@pytest.mark.parametrize('entry', [e if e in DEFAULT_HELP or not e.startswith('experiments') else
                                   pytest.param(e, marks=pytest.mark.slow) for e in ENTRY_POINTS])
def test_help_lists_the_entry_points_own_flags_and_exits_0(entry):
  """`--help` of every entry point exits 0 and lists the flags it defines (the experiment runners: every group of
  the experiment flags; run.py: every registered method), never only absl's pointer to --helpfull."""
  import subprocess
  import sys
  command = ([sys.executable, entry] if entry.startswith('experiments') else
             [sys.executable, '-m', entry[:-3].replace('/', '.')])
  result = subprocess.run(command + ['--help'], capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert result.returncode == 0, result.stderr[-2000:]
  with open(os.path.join(ROOT, entry)) as f:
    source = f.read()
  own = defined_flags(source)
  if 'cli.define_flags' in source:
    assert all(group in result.stdout for group in EXPERIMENT_GROUPS), result.stdout
    own += ['rounds', 'dataset', 'local_learning_rate', 'strategy', 'dp_mode', 'workdir']
  listed = [name for name in own if f'--{name}' in result.stdout or f'--[no]{name}' in result.stdout]
  assert own and listed == own, (own, result.stdout)
  assert 'Try --helpfull' not in result.stdout
  if entry == 'experiments/run.py':
    from fedjax_het.run.registry import METHODS
    assert result.stdout.split('METHODS): ', 1)[1].split('.', 1)[0].split(', ') == list(METHODS)
