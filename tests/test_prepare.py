"""`python -m fedjax_het.data.prepare`: names, sizes, errors, and a prepared dataset read by the loader; offline (tfds's
builder is replaced by one that writes a few generated images, and downloads fail on purpose)."""

import glob
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
import zipfile

import numpy as np
import pytest
import requests
import tensorflow_datasets as tfds
from PIL import Image

from fedjax_het.data import load_dataset, load_npz, load_tfds
from fedjax_het.data import prepare
from fedjax_het.data.datasets import TFDS_DATASETS
from fedjax_het.errors import DatasetUnavailableError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = 'python -m fedjax_het.data.prepare'


def png(array: np.ndarray) -> bytes:
  buffer = io.BytesIO()
  Image.fromarray(array).save(buffer, format='png')
  return buffer.getvalue()


class FewMnist(tfds.image_classification.MNIST, skip_registration=True):
  """tfds's MNIST builder (its name, version and features) writing 12 training and 5 test images it makes itself
  instead of downloading: PNG bytes, so that building needs no TensorFlow."""
  name = 'mnist'

  def _split_generators(self, dl_manager):
    return {'train': self._generate_examples(12), 'test': self._generate_examples(5)}

  def _generate_examples(self, n):
    rng = np.random.default_rng(n)
    for i in range(n):
      yield i, {'image': png(rng.integers(0, 256, (28, 28), dtype=np.uint8)), 'label': i % 10}


class Unreachable:
  """A builder whose download fails the way tfds's does without network; the sizes are its info's."""

  def __init__(self, data_dir, error=None, download_size=0, dataset_size=0):
    self.data_dir = os.path.join(data_dir, 'cifar10', '3.0.2')
    self.info = type('Info', (), {'download_size': download_size, 'dataset_size': dataset_size})()
    self.error, self.calls = error, []

  @property
  def url_infos(self):
    raise ModuleNotFoundError('importlib_resources')  # as tfds 4.9 on a machine without it

  def download_and_prepare(self, **kwargs):
    self.calls.append(kwargs)
    raise self.error


@pytest.fixture
def builds(monkeypatch):
  """tfds's builder replaced by FewMnist for 'mnist'; the modules a real build needs taken as present."""
  monkeypatch.setattr(prepare, 'BUILD_MODULES', ())
  monkeypatch.setattr(prepare, 'resolve_host', lambda host: None)
  monkeypatch.setattr(tfds, 'builder', lambda name, data_dir=None, file_format=None: FewMnist(
      data_dir=data_dir, file_format=file_format))
  return monkeypatch


def test_help_lists_every_name_with_its_sizes(capsys):
  with pytest.raises(SystemExit) as exit_:
    prepare.main(['--help'])
  assert exit_.value.code == 0
  text = capsys.readouterr().out
  for name, sizes in [('mnist', '11.06 MiB / 21.00 MiB'), ('cifar10', '162.17 MiB / 132.40 MiB'),
                      ('svhn_cropped', '1.47 GiB / 1.09 GiB'), ('tinyimagenet', '~237 MiB / 1.26 GiB')]:
    assert re.search(rf'^  {name} +{re.escape(sizes)}', text, re.M), name
  assert all(name in text for name in prepare.SOURCES) and '~/tensorflow_datasets' in text


def test_the_module_runs_as_a_command():
  run = subprocess.run([sys.executable, '-m', 'fedjax_het.data.prepare', '--help'], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
  assert run.returncode == 0 and 'cinic10' in run.stdout and run.stderr == ''


def test_every_dataset_of_the_flag_files_can_be_prepared_or_is_offline():
  values = set()
  for path in glob.glob(os.path.join(ROOT, 'experiments', 'flags', '*.flags')):
    with open(path) as f:
      values |= set(re.findall(r'^--(?:public_)?dataset=(\S+)', f.read(), re.M))
  names = {os.path.splitext(os.path.basename(v[4:].rstrip('.')))[0] if v.startswith('npz:') else v for v in values}
  sources, notes = prepare.resolve_names(sorted(names))  # raises for a name it does not know
  assert {'cifar10', 'mnist', 'tinyimagenet', 'cinic10'} <= {s.name for s in sources}
  assert set(TFDS_DATASETS) <= set(prepare.SOURCES)


@pytest.mark.parametrize('name', TFDS_DATASETS)
def test_download_sizes_and_hosts_are_tfds_checksum_files(name):
  root = os.path.dirname(tfds.__file__)
  paths = glob.glob(os.path.join(root, 'url_checksums', f'{name}.txt')) + glob.glob(
      os.path.join(root, 'datasets', name, 'checksums.tsv'))
  rows = [line.split('\t') for path in paths for line in open(path).read().splitlines() if line.strip()]
  assert rows, name
  source = prepare.SOURCES[name]
  assert sum(int(row[1]) for row in rows) == source.download_bytes
  assert all(row[0].split('/')[2] == source.host for row in rows)


def test_command_line_parsing(monkeypatch, tmp_path, capsys):
  calls = []
  monkeypatch.setattr(prepare, 'prepare', lambda *args: calls.append(args))
  assert prepare.main(['cifar10', 'mnist', f'--data_dir={tmp_path}']) == 0
  assert prepare.main(['tinyimagenet', '--data_dir', str(tmp_path / 'x'), '--archive', 'a.zip']) == 0
  assert calls == [(['cifar10', 'mnist'], str(tmp_path), None), (['tinyimagenet'], str(tmp_path / 'x'), 'a.zip')]
  assert prepare.main([]) == 2 and 'name one or more datasets' in capsys.readouterr().err
  monkeypatch.setenv('TFDS_DATA_DIR', str(tmp_path / 'env'))
  assert prepare.main(['cifar10']) == 0 and calls[-1][1] == str(tmp_path / 'env')


def test_an_unknown_name_is_one_error_naming_the_accepted_ones(monkeypatch, capsys):
  monkeypatch.setattr(tfds, 'builder', lambda *a, **k: pytest.fail('nothing is built when a name is unknown'))
  assert prepare.main(['mnist', 'cifar', 'imagenet']) == 2
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1 and err.startswith('error: ')
  assert "'cifar' (did you mean cifar10 or cifar100?), 'imagenet'" in err
  assert 'mnist, fashion_mnist, cifar10, cifar100, svhn_cropped, tinyimagenet, cinic10' in err and 'Fix:' in err


def test_offline_names_need_no_preparation(capsys):
  assert prepare.main(['digits', 'synthetic:8,8,1', 'npz:mine.npz']) == 0
  assert capsys.readouterr().out.count('nothing to prepare') == 3


def test_sizes_are_printed_before_the_download_from_the_builder_info_else_the_catalog(monkeypatch, tmp_path):
  lines = []
  failing = Unreachable(str(tmp_path), requests.exceptions.ConnectionError('no route'), 3 * 2 ** 20, 5 * 2 ** 20)
  monkeypatch.setattr(prepare, 'BUILD_MODULES', ())
  monkeypatch.setattr(prepare, 'resolve_host', lambda host: None)
  monkeypatch.setattr(tfds, 'builder', lambda *a, **k: failing)
  with pytest.raises(DatasetUnavailableError):
    prepare.prepare(['cifar10'], str(tmp_path), out=lines.append)
  assert lines[1] == f'  download 3.00 MiB, prepared 5.00 MiB -> {failing.data_dir}' and len(failing.calls) == 1
  unknown = Unreachable(str(tmp_path), requests.exceptions.ConnectionError('no route'))  # tfds offline: unknown size
  monkeypatch.setattr(tfds, 'builder', lambda *a, **k: unknown)
  lines.clear()
  with pytest.raises(DatasetUnavailableError):
    prepare.prepare(['cifar10'], str(tmp_path), out=lines.append)
  assert lines[1].startswith('  download 162.17 MiB, prepared 132.40 MiB -> ')


def test_a_network_failure_is_one_line_saying_what_failed_and_how_to_fix_it(monkeypatch, tmp_path, capsys):
  error = requests.exceptions.ConnectionError("HTTPSConnectionPool(host='www.cs.toronto.edu', port=443): Max "
                                              "retries exceeded (Failed to establish a new connection)")
  monkeypatch.setattr(prepare, 'BUILD_MODULES', ())
  monkeypatch.setattr(prepare, 'resolve_host', lambda host: None)  # tfds's download fails after the lookup
  monkeypatch.setattr(tfds, 'builder', lambda *a, **k: Unreachable(str(tmp_path), error))
  assert prepare.main(['cifar10', f'--data_dir={tmp_path}']) == 1
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1 and 'Traceback' not in err
  assert 'cifar10: downloading cifar10 with tfds failed (ConnectionError: ' in err
  assert f'run `{COMMAND} cifar10 --data_dir=DIR` on a machine with internet' in err

  def offline(*args, **kwargs):
    raise urllib.error.URLError(OSError(-3, 'Temporary failure in name resolution'))
  monkeypatch.setattr(urllib.request, 'urlopen', offline)
  assert prepare.main(['cinic10', f'--data_dir={tmp_path}']) == 1
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1 and 'downloading https://datashare.ed.ac.uk/' in err and 'URLError' in err
  assert 'copy DIR/cinic10.npz here and run with --dataset=npz:ITS_PATH' in err
  assert not (tmp_path / 'cinic10.npz').exists()


def test_a_host_that_cannot_be_looked_up_stops_before_tfds_retries(monkeypatch, tmp_path, capsys):
  failing = Unreachable(str(tmp_path), RuntimeError('must not be called'))
  monkeypatch.setattr(prepare, 'BUILD_MODULES', ())
  monkeypatch.setattr(tfds, 'builder', lambda *a, **k: failing)
  for variable in prepare.PROXY_VARIABLES:
    monkeypatch.delenv(variable, raising=False)

  def no_dns(host, port):
    raise socket.gaierror(-2, 'Name or service not known')
  monkeypatch.setattr(socket, 'getaddrinfo', no_dns)
  assert prepare.main(['cifar10', f'--data_dir={tmp_path}']) == 1
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1 and failing.calls == []
  assert 'cifar10: downloading from www.cs.toronto.edu failed (gaierror: [Errno -2] Name or service not known)' in err
  monkeypatch.setenv('HTTPS_PROXY', 'http://proxy:3128')  # the proxy looks the host up
  with pytest.raises(RuntimeError, match='must not be called'):
    prepare.main(['cifar10', f'--data_dir={tmp_path}'])


def test_a_missing_build_module_stops_before_any_download(monkeypatch, tmp_path, capsys):
  failing = Unreachable(str(tmp_path), RuntimeError('must not be called'))
  monkeypatch.setattr(prepare, 'BUILD_MODULES', ('tensorflow_is_not_here',))
  monkeypatch.setattr(tfds, 'builder', lambda *a, **k: failing)
  assert prepare.main(['cifar10', f'--data_dir={tmp_path}']) == 1
  assert 'Fix: pip install tensorflow_is_not_here' in capsys.readouterr().err and failing.calls == []


def test_missing_data_errors_name_the_prepare_command(tmp_path):
  with pytest.raises(DatasetUnavailableError, match=re.escape(f'`{COMMAND} cifar100 --data_dir={tmp_path}`')):
    load_tfds('cifar100', data_dir=str(tmp_path))
  with pytest.raises(DatasetUnavailableError, match=re.escape(f'`{COMMAND} tinyimagenet`')):
    load_dataset(f'npz:{tmp_path}/tinyimagenet.npz')
  with pytest.raises(DatasetUnavailableError, match=re.escape(f'`{COMMAND} cinic10`')):
    load_dataset('npz:/path/to/cinic10.npz')


def test_a_prepared_dataset_loads_through_the_library(builds, tmp_path, capsys):
  data_dir = str(tmp_path)
  assert prepare.main(['mnist', f'--data_dir={data_dir}']) == 0
  out = capsys.readouterr().out
  folder = os.path.join(data_dir, 'mnist', '3.0.1')
  assert f'-> {folder}' in out and f'use: --dataset=mnist --data_dir={data_dir}' in out
  builds.undo()  # the library reads with tfds as it is
  ds = load_dataset('mnist', data_dir=data_dir)
  assert ds.x.shape == (12, 28, 28, 1) and ds.x_test.shape == (5, 28, 28, 1) and ds.num_classes == 10
  assert ds.x.min() >= -1 and ds.x.max() <= 1
  assert prepare.main(['--list', f'--data_dir={data_dir}']) == 0
  listing = capsys.readouterr().out
  assert re.search(rf'^  mnist +prepared, [\d.]+ KiB in {re.escape(folder)}', listing, re.M)
  assert re.search(r'^  cifar10 +not prepared$', listing, re.M)
  assert prepare.main(['mnist', f'--data_dir={data_dir}']) == 0
  assert 'already prepared' in capsys.readouterr().out


def test_a_tfrecord_build_is_named_with_the_fix(builds, tmp_path, capsys):
  data_dir = str(tmp_path)
  assert prepare.main(['mnist', f'--data_dir={data_dir}']) == 0
  folder = tmp_path / 'mnist' / '3.0.1'
  info = folder / 'dataset_info.json'
  info.write_text(json.dumps(dict(json.loads(info.read_text()), fileFormat='tfrecord')))  # as `tfds build mnist`
  with pytest.raises(DatasetUnavailableError, match=r'built as tfrecord files.*' + re.escape(
      f'`{COMMAND} mnist --data_dir={data_dir}`')):
    load_tfds('mnist', data_dir=data_dir)
  assert prepare.main(['--list', f'--data_dir={data_dir}']) == 0
  assert f'prepared as tfrecord in {folder}' in capsys.readouterr().out
  assert prepare.main(['mnist', f'--data_dir={data_dir}']) == 1
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1 and f'{folder} holds a tfrecord build' in err
  assert 'Fix: delete that folder and run this again' in err
  shutil.rmtree(folder)
  assert prepare.main(['mnist', f'--data_dir={data_dir}']) == 0
  assert load_tfds('mnist', data_dir=data_dir).x.shape == (12, 28, 28, 1)


def jpeg(rng, grey=False) -> bytes:
  buffer = io.BytesIO()
  Image.fromarray(rng.integers(0, 256, (64, 64) if grey else (64, 64, 3), dtype=np.uint8)).save(buffer, 'JPEG')
  return buffer.getvalue()


def test_tinyimagenet_from_its_archive(tmp_path, capsys):
  rng = np.random.default_rng(0)
  archive = tmp_path / 'tiny-imagenet-200.zip'
  with zipfile.ZipFile(archive, 'w') as z:  # the original layout: 2 classes, 3 training images each, 3 val images
    z.writestr('tiny-imagenet-200/wnids.txt', 'n02\nn01\n')
    for wnid in ('n02', 'n01'):
      for i in range(3):
        z.writestr(f'tiny-imagenet-200/train/{wnid}/images/{wnid}_{i}.JPEG', jpeg(rng, grey=i == 0))
      z.writestr(f'tiny-imagenet-200/train/{wnid}/{wnid}_boxes.txt', '')
    for i in range(3):
      z.writestr(f'tiny-imagenet-200/val/images/val_{i}.JPEG', jpeg(rng))
    z.writestr('tiny-imagenet-200/val/val_annotations.txt',
               'val_0.JPEG\tn02\t0\t0\t9\t9\nval_1.JPEG\tn01\t1\t1\t9\t9\nval_2.JPEG\tn02\t0\t0\t5\t5\n')
    z.writestr('tiny-imagenet-200/test/images/test_0.JPEG', jpeg(rng))
  assert prepare.main(['tinyimagenet', f'--archive={archive}', f'--data_dir={tmp_path / "data"}']) == 0
  path = tmp_path / 'data' / 'tinyimagenet.npz'
  assert f'use: --dataset=npz:{path}' in capsys.readouterr().out
  ds = load_dataset(f'npz:{path}')
  assert ds.x.shape == (6, 64, 64, 3) and ds.x_test.shape == (3, 64, 64, 3) and ds.num_classes == 2
  assert ds.y.tolist() == [0, 0, 0, 1, 1, 1] and sorted(ds.y_test.tolist()) == [0, 1, 1]  # n01 -> 0, n02 -> 1


def test_cinic10_from_its_archive_without_its_valid_split(tmp_path):
  rng = np.random.default_rng(0)
  archive = tmp_path / 'CINIC-10.tar.gz'
  with tarfile.open(archive, 'w:gz') as tar:
    for split, count in (('train', 2), ('valid', 1), ('test', 1)):
      for cls in ('truck', 'airplane'):
        for i in range(count):
          data = png(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))
          member = tarfile.TarInfo(f'{split}/{cls}/n0{i}.png')
          member.size = len(data)
          tar.addfile(member, io.BytesIO(data))
  prepare.prepare(['cinic10'], str(tmp_path), archive=str(archive), out=lambda line: None)
  ds = load_npz(str(tmp_path / 'cinic10.npz'))
  assert ds.x.shape == (4, 32, 32, 3) and ds.x_test.shape == (2, 32, 32, 3) and ds.num_classes == 10
  assert sorted(ds.y.tolist()) == [0, 0, 9, 9] and sorted(ds.y_test.tolist()) == [0, 9]
