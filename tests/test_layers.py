"""The package's floors: every import, lazy ones included, goes to the same floor or one below (docs/design.md)."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / 'fedjax_het'

# Floor of each top-level module or sub-package, lowest first.
FLOORS = (
    ('fedjax_het', 'fedjax_het.errors', 'fedjax_het.rows'),
    ('fedjax_het.data', 'fedjax_het.kernels'),
    ('fedjax_het.models',),
    ('fedjax_het.local_training', 'fedjax_het.optim', 'fedjax_het.uploads', 'fedjax_het.core', 'fedjax_het.robust'),
    ('fedjax_het.generators',),
    ('fedjax_het.engine',),
    ('fedjax_het.methods',),
    ('fedjax_het.privacy',),
    ('fedjax_het.evaluation',),
    ('fedjax_het.run',),
    ('fedjax_het.flower',),
)
FLOOR = {unit: level for level, units in enumerate(FLOORS) for unit in units}


def unit_of(module: str) -> str:
  """The top-level module or sub-package that `module` belongs to."""
  return '.'.join(module.split('.')[:2])


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def imported_modules(path: pathlib.Path) -> set[str]:
  """Every fedjax_het module that the file imports, at the top or inside a function."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith('fedjax_het'):
      found.add(node.module)
      if node.module == 'fedjax_het':
        found.update(f'fedjax_het.{a.name}' for a in node.names)
    elif isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name.startswith('fedjax_het'))
  return found


def import_edges() -> list[tuple[str, str]]:
  """(importing module, imported module) over the package."""
  return [(module_name(path), imported) for path in sorted(PACKAGE.rglob('*.py'))
          for imported in sorted(imported_modules(path))]


def test_every_module_has_a_floor():
  units = {unit_of(module_name(path)) for path in PACKAGE.rglob('*.py')}
  assert units - set(FLOOR) == set(), 'place the new module or package in FLOORS (and in docs/design.md)'


def test_no_import_goes_up_a_floor():
  upward = [f'{source} -> {target}' for source, target in import_edges()
            if FLOOR[unit_of(target)] > FLOOR[unit_of(source)]]
  assert upward == []


def test_the_check_finds_an_upward_import(tmp_path, monkeypatch):
  """The rule catches a lazy import from a lower floor to a higher one."""
  package = tmp_path / 'fedjax_het'
  (package / 'methods').mkdir(parents=True)
  (package / 'methods' / 'm.py').write_text('def f():\n  from fedjax_het.run import experiment\n')
  monkeypatch.setattr(__import__(__name__), 'PACKAGE', package)
  edges = import_edges()
  assert edges == [('fedjax_het.methods.m', 'fedjax_het.run')]
  assert FLOOR[unit_of(edges[0][1])] > FLOOR[unit_of(edges[0][0])]


@pytest.mark.parametrize('floor', ['fedjax_het.core', 'fedjax_het.engine', 'fedjax_het.methods'])
def test_the_library_floors_import_no_run_settings(floor):
  """The engine and the methods never read flags or the run's config (they take records)."""
  names = {target for source, target in import_edges() if unit_of(source) == floor}
  assert not any(unit_of(name) in ('fedjax_het.run', 'fedjax_het.flower') for name in names)


def test_importing_any_module_initialises_no_jax_backend():
  """A multi-process run joins its processes (jax.distributed.initialize) after the imports; anything computed
  with JAX at import time (a module-level jnp constant) would initialise the backend first and fail that join."""
  import subprocess
  import sys
  script = ('import importlib, pkgutil, fedjax_het\n'
            'import jax._src.xla_bridge as xb\n'
            'for m in pkgutil.walk_packages(fedjax_het.__path__, "fedjax_het."):\n'
            '  importlib.import_module(m.name)\n'
            '  assert not xb._backends, m.name\n')
  root = pathlib.Path(__file__).resolve().parent.parent
  result = subprocess.run([sys.executable, '-c', script], cwd=root, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
