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
