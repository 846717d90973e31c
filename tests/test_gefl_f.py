"""GeFL-F's checks (gefl_f_checks.py) in a pytest process of their own.

In the full suite, a worker that had run other test files crashed (a segfault inside XLA:CPU, compiling or
serialising one of GeFL-F's programs) in 6 of 6 runs, always in this file; run alone, the same tests pass (a 7th run
crashed deserialising a cached executable in test_phases.py, so the cause is not GeFL-F's). A
fresh process isolates them until the cause is found (a crash then fails this one test instead of the worker).
"""

import os
import subprocess
import sys


def test_gefl_f_checks_pass_in_a_process_of_their_own():
  here = os.path.dirname(__file__)
  proc = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-p', 'no:randomly',
                         os.path.join(here, 'gefl_f_checks.py')], cwd=os.path.dirname(here), capture_output=True,
                        text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
  assert ' passed' in proc.stdout and 'failed' not in proc.stdout
