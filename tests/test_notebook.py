"""examples/quickstart.ipynb runs from top to bottom in a fresh kernel (nbclient, the runner Jupyter itself uses):
FedRE's five rounds, the method written in the notebook and the accuracy plot."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Slow (`-m slow`): a Jupyter kernel and the quickstart's run, about 12 s of a 2-core CPU; the default run executes
# README's notebook snippet in-process (tests/test_experiment.py).
@pytest.mark.slow
def test_the_quickstart_notebook_runs_and_draws_its_plot(capfd, tmp_path):
  nbformat = pytest.importorskip('nbformat')
  nbclient = pytest.importorskip('nbclient')
  from jupyter_client.manager import AsyncKernelManager
  notebook = nbformat.read(os.path.join(ROOT, 'examples', 'quickstart.ipynb'), as_version=4)
  for cell in notebook.cells:
    cell.outputs = [] if cell.cell_type == 'code' else cell.get('outputs')  # run it afresh, not the stored outputs
  # The kernel inherits this process's environment: the suite's XLA settings and compilation cache.
  client = nbclient.NotebookClient(notebook, timeout=600, kernel_name='python3',
                                   resources={'metadata': {'path': os.path.join(ROOT, 'examples')}})
  # Over local sockets (ipc, at an absolute path: the kernel runs in examples/), not TCP: ipykernel warns of a
  # kernel 'running over TCP without encryption'.
  client.km = AsyncKernelManager(kernel_name='python3', transport='ipc', ip=str(tmp_path / 'kernel'))
  client.execute()
  assert 'without encryption' not in ''.join(capfd.readouterr())
  printed = ''.join(o.get('text', '') for c in notebook.cells if c.cell_type == 'code' for o in c.outputs)
  curves = [[float(a) for a in re.findall(r'[\d.]+', line)]
            for line in re.findall(r'accuracy per round: \[(.*)\]', printed)]
  assert len(curves) == 2 and all(len(c) == 5 and all(0 <= a <= 1 for a in c) for c in curves), printed
  assert max(curves[0]) > 0.5  # FedRE learns the digits within five rounds
  images = [o for c in notebook.cells if c.cell_type == 'code' for o in c.outputs if 'image/png' in o.get('data', {})]
  assert len(images) == 1
