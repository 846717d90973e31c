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
  assert missing_imports('from fedjax_het.algorithms.common import descend, no_such_thing\n'
                         'from fedjax_het.engine import executors') == ['fedjax_het.algorithms.common.no_such_thing']


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


def test_run_py_help_lists_every_registered_method():
  import subprocess
  import sys
  from fedjax_het.methods import METHODS
  result = subprocess.run([sys.executable, os.path.join(ROOT, 'experiments', 'run.py'), '--help'],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
  listed = result.stdout.split('METHODS): ', 1)[1].split('.', 1)[0]
  assert listed.split(', ') == list(METHODS)

