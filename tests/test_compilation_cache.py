"""XLA's persistent compilation cache of experiment runs (fedjax_het/run/compilation_cache.py), in fresh processes:
the flag's folder receives the compiled programs, and a folder configured already (JAX_COMPILATION_CACHE_DIR, as
this suite sets for its subprocesses) is kept."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM = ('import sys, jax; from fedjax_het.run.compilation_cache import use_compilation_cache; '
           'used = use_compilation_cache(sys.argv[1]); '
           "jax.config.update('jax_persistent_cache_min_compile_time_secs', 0); "
           'jax.jit(lambda x: x * 3.0)(1.0).block_until_ready(); print(used)')


def run_program(folder, env_folder=None):
  env = {k: v for k, v in os.environ.items() if k != 'JAX_COMPILATION_CACHE_DIR'}
  if env_folder:
    env['JAX_COMPILATION_CACHE_DIR'] = str(env_folder)
  result = subprocess.run([sys.executable, '-c', PROGRAM, str(folder)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env)
  assert result.returncode == 0, result.stderr
  return result.stdout.strip().splitlines()[-1]


def test_the_flags_folder_is_created_and_receives_the_compiled_programs(tmp_path):
  folder = tmp_path / 'new' / 'xla'
  assert run_program(folder) == str(folder)
  assert os.listdir(folder)


def test_a_folder_configured_already_is_kept(tmp_path):
  mine, configured = tmp_path / 'mine', tmp_path / 'configured'
  assert run_program(mine, env_folder=configured) == str(configured)
  assert not mine.exists() and os.listdir(configured)


def test_an_empty_flag_leaves_the_cache_off(tmp_path):
  assert run_program('') == 'None'


def test_a_folder_that_cannot_be_created_leaves_the_cache_off_with_a_warning(tmp_path):
  blocker = tmp_path / 'a_file'
  blocker.write_text('')
  assert run_program(blocker / 'xla') == 'None'
