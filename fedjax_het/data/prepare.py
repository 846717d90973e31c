"""Downloads and prepares the datasets of the paper flag files once, so that every run after it needs no network.

  python -m fedjax_het.data.prepare cifar10 mnist             # into ~/tensorflow_datasets (or $TFDS_DATA_DIR)
  python -m fedjax_het.data.prepare cifar10 --data_dir=DIR    # then run with --data_dir=DIR
  python -m fedjax_het.data.prepare --list [--data_dir=DIR]   # what DIR holds already
  python -m fedjax_het.data.prepare tinyimagenet --archive=tiny-imagenet-200.zip   # a copied archive, offline

The tfds datasets (mnist, fashion_mnist, cifar10, cifar100, svhn_cropped) are built by tfds as array_record files in
DATA_DIR/NAME/VERSION, the format the loader reads (`tfds build NAME --file_format=array_record`); a run reads them
with --dataset=NAME --data_dir=DATA_DIR. tfds has no Tiny-ImageNet or CINIC-10: their original archives are
downloaded into DATA_DIR/downloads and converted into DATA_DIR/tinyimagenet.npz and DATA_DIR/cinic10.npz, read with
--dataset=npz:PATH. Raw downloads stay in DATA_DIR/downloads and may be deleted once a dataset is prepared.

Building a tfds dataset needs TensorFlow, which runs do not (tfds reads and encodes the raw files with it), and with
tfds 4.9 importlib_resources: pip install tensorflow importlib_resources on the machine that prepares.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import http.client
import io
import json
import os
import re
import shutil
import socket
import sys
import tarfile
import urllib.error
import urllib.request
import zipfile
from typing import Callable, Optional, Sequence

import numpy as np

from fedjax_het.data.datasets import OFFLINE_DATASETS, PREPARE_COMMAND, TFDS_DATASETS
from fedjax_het.errors import (EXIT_FAILED, EXIT_USAGE, ConfigError, DatasetUnavailableError, argument_parser,
                               error_line)

MIB = 2 ** 20
GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Source:
  """A dataset this command prepares: a tfds name (`url` empty) or an original archive converted to NAME.npz.

  `download_bytes` and `prepared_bytes` are the sizes shown before anything is fetched: for tfds, its catalog's
  figures (the download the sum of its checksum file's entries); tfds's builder info replaces them where it knows
  them. `approximate` marks a size given to about 1 %."""
  name: str
  description: str
  download_bytes: int
  prepared_bytes: int
  url: str = ''
  archive: str = ''
  approximate: bool = False
  host: str = ''  # where a tfds download comes from (checked before tfds's minutes of retries)

  @property
  def is_tfds(self) -> bool:
    return not self.url


SOURCES = {s.name: s for s in (
    Source('mnist', 'MNIST: 70,000 28x28 grey digits, 10 classes', 11_594_722, int(21.00 * MIB),
           host='storage.googleapis.com'),
    Source('fashion_mnist', 'Fashion-MNIST: 70,000 28x28 grey clothes, 10 classes', 30_878_645, int(36.42 * MIB),
           host='fashion-mnist.s3-website.eu-central-1.amazonaws.com'),
    Source('cifar10', 'CIFAR-10: 60,000 32x32 colour images, 10 classes', 170_052_171, int(132.40 * MIB),
           host='www.cs.toronto.edu'),
    Source('cifar100', 'CIFAR-100: 60,000 32x32 colour images, 100 classes', 168_513_733, int(132.03 * MIB),
           host='www.cs.toronto.edu'),
    Source('svhn_cropped', 'SVHN: 99,289 32x32 digits, 10 classes (+531,131 "extra", built, not read)',
           1_575_594_780, int(1.09 * GIB), host='ufldl.stanford.edu'),
    Source('tinyimagenet', 'Tiny-ImageNet: 110,000 64x64 images, 200 classes (val as test) -> .npz',
           int(237 * MIB), 110_000 * (64 * 64 * 3 + 4),
           url='http://cs231n.stanford.edu/tiny-imagenet-200.zip', archive='tiny-imagenet-200.zip',
           approximate=True),
    Source('cinic10', 'CINIC-10: 180,000 32x32 images, 10 classes (train, test; not valid) -> .npz',
           int(655 * MIB), 180_000 * (32 * 32 * 3 + 4),
           url='https://datashare.ed.ac.uk/bitstream/handle/10283/3192/CINIC-10.tar.gz', archive='CINIC-10.tar.gz',
           approximate=True),
)}
assert set(TFDS_DATASETS) <= set(SOURCES)  # every tfds name the loader accepts can be prepared

# Modules a tfds build imports beyond what loading needs: TensorFlow reads and encodes the raw files; tfds 4.9
# looks up its checksum files through importlib_resources on every Python version.
BUILD_MODULES = ('tensorflow', 'importlib_resources')


def default_data_dir() -> str:
  """tfds's default data folder: $TFDS_DATA_DIR, else ~/tensorflow_datasets (what the loader reads without
  --data_dir)."""
  return os.environ.get('TFDS_DATA_DIR', os.path.join(os.path.expanduser('~'), 'tensorflow_datasets'))


def format_size(num_bytes: int, approximate: bool = False) -> str:
  """`num_bytes` as tfds prints sizes (binary units, two decimals): 132.40 MiB; '~' in front when approximate."""
  size, unit = float(num_bytes), 'bytes'
  for next_unit in ('KiB', 'MiB', 'GiB', 'TiB'):
    if size < 1024:
      break
    size, unit = size / 1024, next_unit
  if approximate:
    return f'~{size:.0f} {unit}'
  return f'{int(size)} {unit}' if unit == 'bytes' else f'{size:.2f} {unit}'


def resolve_names(names: Sequence[str]) -> tuple[list[Source], list[str]]:
  """The sources to prepare, in order without repeats, and notes for names that need no preparation (offline
  datasets, npz:PATH); one ConfigError naming every unknown name and the accepted ones."""
  sources, notes, unknown = [], [], []
  for name in names:
    if name in SOURCES:
      if SOURCES[name] not in sources:
        sources.append(SOURCES[name])
    elif name in OFFLINE_DATASETS or name.split(':', 1)[0] == 'synthetic':
      notes.append(f'{name}: offline, nothing to prepare (--dataset={name} works as it is).')
    elif name.startswith('npz:'):
      notes.append(f'{name}: a file of yours, nothing to prepare (--dataset={name} reads it).')
    else:
      unknown.append(name)
  if unknown:
    hints = [f'{n!r} (did you mean {" or ".join(m)}?)' if (m := _close_names(n)) else repr(n) for n in unknown]
    raise ConfigError(f'{PREPARE_COMMAND}: unknown dataset {", ".join(hints)}. Fix: name one or more of '
                      f'{", ".join(SOURCES)}; {", ".join(OFFLINE_DATASETS)} and npz:PATH need no preparation.')
  return sources, notes


def _close_names(name: str) -> list[str]:
  """The dataset names `name` may have meant: those it begins ('svhn' -> svhn_cropped), else near spellings."""
  key = name.lower().replace('-', '').replace('_', '')
  return ([s for s in SOURCES if key and s.replace('_', '').startswith(key)]
          or difflib.get_close_matches(name.lower(), SOURCES, n=1, cutoff=0.6))


def _disk_bytes(path: str) -> int:
  """Bytes of the files under `path` (a file or a folder)."""
  if os.path.isfile(path):
    return os.path.getsize(path)
  return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def _tfds_versions(data_dir: str, name: str) -> list[tuple[str, str]]:
  """(version, file format) of each prepared copy of tfds dataset `name` under `data_dir`."""
  found = []
  folder = os.path.join(data_dir, name)
  for version in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
    info = os.path.join(folder, version, 'dataset_info.json')
    if os.path.isfile(info):
      try:
        with open(info) as f:
          file_format = json.load(f).get('fileFormat', 'tfrecord')
      except (OSError, ValueError):
        file_format = 'unreadable'
      found.append((version, file_format))
  return found


def list_prepared(data_dir: str, out: Callable[[str], None] = print) -> None:
  """Prints, for every dataset this command prepares, whether `data_dir` holds it, where, and its size."""
  out(f'Data folder: {data_dir}' + ('' if os.path.isdir(data_dir) else ' (does not exist yet)'))
  width = max(map(len, SOURCES))
  for s in SOURCES.values():
    if s.is_tfds:
      found = _tfds_versions(data_dir, s.name)
      ready = [(v, fmt) for v, fmt in found if fmt == 'array_record']
      if ready:
        version = ready[-1][0]
        path = os.path.join(data_dir, s.name, version)
        line = f'prepared, {format_size(_disk_bytes(path))} in {path} (--dataset={s.name} --data_dir={data_dir})'
      elif found:
        line = (f'prepared as {found[-1][1]} in {os.path.join(data_dir, s.name, found[-1][0])}, which the loader '
                f'cannot read (it needs array_record). Fix: delete that folder, then {PREPARE_COMMAND} {s.name} '
                f'--data_dir={data_dir}')
      else:
        line = 'not prepared'
    else:
      path = os.path.join(data_dir, f'{s.name}.npz')
      line = (f'prepared, {format_size(os.path.getsize(path))} in {path} (--dataset=npz:{path})'
              if os.path.isfile(path) else 'not prepared')
    out(f'  {s.name:<{width}}  {line}')
  downloads = os.path.join(data_dir, 'downloads')
  if os.path.isdir(downloads) and _disk_bytes(downloads):
    out(f'Raw downloads: {format_size(_disk_bytes(downloads))} in {downloads} (may be deleted once prepared).')


def _network_failure(error: BaseException) -> Optional[BaseException]:
  """The exception in `error`'s chain that says a download failed (no network, DNS, refused, timeout, HTTP error,
  a checksum that does not match), or None."""
  kinds = [urllib.error.URLError, ConnectionError, TimeoutError, socket.gaierror, socket.timeout,
           http.client.HTTPException]
  try:
    import requests
    kinds.append(requests.exceptions.RequestException)
  except ImportError:
    pass
  try:
    from tensorflow_datasets.core.download.download_manager import NonMatchingChecksumError
    from tensorflow_datasets.core.download.util import DownloadError
    kinds += [DownloadError, NonMatchingChecksumError]
  except ImportError:
    pass
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, tuple(kinds)):
      return error
    error = error.__cause__ or error.__context__
  return None


def _download_failed(name: str, what: str, error: BaseException, data_dir: str) -> DatasetUnavailableError:
  """The one-line error for a failed download of `what` (a URL or a dataset)."""
  detail = ' '.join(str(error).split())[:160]
  source = SOURCES[name]
  elsewhere = ('copy DIR to this machine and pass --data_dir=DIR to runs' if source.is_tfds else
               f'copy DIR/{name}.npz here and run with --dataset=npz:ITS_PATH (or copy {source.archive} here and '
               f'add --archive=ITS_PATH)')
  return DatasetUnavailableError(
      f'{name}: downloading {what} failed ({type(error).__name__}: {detail}). Fix: check the connection (a proxy is '
      f'read from HTTP_PROXY / HTTPS_PROXY), or run `{PREPARE_COMMAND} {name} --data_dir=DIR` on a machine with '
      f'internet, {elsewhere}; the data folder here is {data_dir}.')


PROXY_VARIABLES = ('HTTP_PROXY', 'HTTPS_PROXY', 'ALL_PROXY', 'http_proxy', 'https_proxy', 'all_proxy')


def resolve_host(host: str) -> None:
  """Looks `host` up in DNS (raises socket.gaierror when it cannot be found, as without network); nothing to do
  through a proxy, which looks hosts up itself."""
  if host and not any(os.environ.get(v) for v in PROXY_VARIABLES):
    socket.getaddrinfo(host, 443)


def check_reachable(name: str, host: str, data_dir: str) -> None:
  """One DatasetUnavailableError at once when `host` cannot be looked up, instead of tfds's retries for minutes."""
  try:
    resolve_host(host)
  except OSError as e:
    raise _download_failed(name, f'from {host}', e, data_dir) from None


def check_build_modules(name: str) -> None:
  """A ConfigError before anything is downloaded when a module that tfds's build imports is missing."""
  import importlib.util
  missing = [m for m in BUILD_MODULES if importlib.util.find_spec(m) is None]
  if missing:
    raise ConfigError(f'{name}: building a tfds dataset needs {" and ".join(missing)} (tfds reads and encodes the '
                      f'raw files with TensorFlow), which {"is" if len(missing) == 1 else "are"} not installed. Fix: '
                      f'pip install {" ".join(missing)}; or prepare on a machine that has them and copy the data '
                      f'folder.')


def make_builder(name: str, data_dir: str):
  """tfds's builder of `name` under `data_dir`, writing array_record files (the format the loader reads)."""
  import tensorflow_datasets as tfds
  return tfds.builder(name, data_dir=data_dir, file_format='array_record')


def tfds_sizes(builder, source: Source) -> tuple[int, int]:
  """(download, prepared) bytes of a tfds dataset: tfds's builder info where it knows them (after a build, or
  restored from tfds's servers), else the sum of its checksum file, else the catalog's figures in `source`."""
  download = prepared = 0
  try:
    download, prepared = int(builder.info.download_size), int(builder.info.dataset_size)
  except Exception:  # info tfds cannot restore offline
    pass
  if not download:
    try:
      download = sum(int(u.size) for u in (builder.url_infos or {}).values())
    except Exception:  # tfds reads the checksum file through modules a load does not need
      pass
  return download or source.download_bytes, prepared or source.prepared_bytes


def prepare_tfds(source: Source, data_dir: str, out: Callable[[str], None] = print) -> str:
  """Builds tfds dataset `source` in `data_dir` (sizes printed first); returns its folder."""
  folder, state = _existing_build(source.name, data_dir)
  if state not in ('', 'array_record'):  # tfds would keep it as it is (and refuses another format in its folder)
    raise ConfigError(f'{source.name}: {folder} holds a {state} build (what `tfds build {source.name}` writes), which '
                      f'the loader cannot read. Fix: delete that folder and run this again (the raw downloads in '
                      f'{os.path.join(data_dir, "downloads")} are reused), or prepare into another --data_dir.')
  builder = make_builder(source.name, data_dir)
  download, prepared = tfds_sizes(builder, source)
  out(f'{source.name}: {source.description}')
  out(f'  download {format_size(download)}, prepared {format_size(prepared)} -> {builder.data_dir}')
  if state:
    out(f'  already prepared ({format_size(_disk_bytes(builder.data_dir))}).')
  else:
    check_build_modules(source.name)
    check_reachable(source.name, source.host, data_dir)
    try:
      builder.download_and_prepare()
    except Exception as e:
      failure = _network_failure(e)
      if failure is None:
        raise
      raise _download_failed(source.name, f'{source.name} with tfds', failure, data_dir) from None
    out(f'  prepared: {format_size(_disk_bytes(builder.data_dir))} in {builder.data_dir}.')
  out(f'  use: --dataset={source.name} --data_dir={data_dir}')
  return str(builder.data_dir)


def _existing_build(name: str, data_dir: str) -> tuple[str, str]:
  """The folder of tfds dataset `name`'s current version under `data_dir` and the file format of the finished
  build in it ('array_record', 'tfrecord', ...; '' when there is none)."""
  import tensorflow_datasets as tfds
  folder = os.path.join(data_dir, name, str(tfds.builder_cls(name).VERSION))
  info = os.path.join(folder, 'dataset_info.json')
  if not os.path.isfile(info):
    return folder, ''
  with open(info) as f:
    return folder, json.load(f).get('fileFormat', 'tfrecord')


def download(url: str, dest: str, name: str, data_dir: str, out: Callable[[str], None] = print) -> None:
  """Fetches `url` into `dest` (through `dest`.part, so an interrupted download is not taken for a finished one);
  a network failure becomes one DatasetUnavailableError."""
  os.makedirs(os.path.dirname(dest), exist_ok=True)
  partial = dest + '.part'
  try:
    with urllib.request.urlopen(url, timeout=60) as response, open(partial, 'wb') as f:
      length = response.headers.get('Content-Length')
      out(f'  downloading {url}' + (f' ({format_size(int(length))})' if length and length.isdigit() else ''))
      shutil.copyfileobj(response, f, 1 << 20)
  except Exception as e:
    if os.path.exists(partial):
      os.remove(partial)
    failure = _network_failure(e)
    if failure is None:
      raise
    raise _download_failed(name, url, failure, data_dir) from None
  os.replace(partial, dest)


def _decode(data: bytes, where: str) -> np.ndarray:
  """An encoded image (JPEG, PNG) as uint8 [H, W, 3]; grey images are repeated to three channels, as
  torchvision's ImageFolder loader (PIL's convert('RGB')) does."""
  from PIL import Image
  try:
    with Image.open(io.BytesIO(data)) as image:
      return np.asarray(image.convert('RGB'), dtype=np.uint8)
  except Exception as e:  # PIL raises several types for a damaged file
    raise ConfigError(f'{where}: not a readable image ({type(e).__name__}). Fix: download the archive again.') from None


def _stack(images: list[np.ndarray], where: str) -> np.ndarray:
  """The images as one [N, H, W, 3] array, or a ConfigError when their sizes differ."""
  shapes = {im.shape for im in images}
  if len(shapes) != 1:
    raise ConfigError(f'{where}: images of several sizes {sorted(shapes)[:3]}. Fix: download the original archive '
                      f'again.')
  return np.stack(images)


def convert_tinyimagenet(archive: str, out: Callable[[str], None] = print) -> dict[str, np.ndarray]:
  """The arrays of tinyimagenet.npz from `tiny-imagenet-200.zip`: x/y its train split (500 per class), x_test/
  y_test its labelled val split (50 per class, labels from val/val_annotations.txt); its test split has no labels
  and is left out. Classes are numbered in the sorted order of their WordNet ids (torchvision's ImageFolder order)."""
  where = f'{archive} (Tiny-ImageNet)'
  with zipfile.ZipFile(archive) as z:
    names = z.namelist()
    train = sorted((m.group(1), n) for n in names if (m := re.search(r'(?:^|/)train/(n\d+)/images/[^/]+\.jpe?g$',
                                                                          n, re.I)))
    annotations = [n for n in names if re.search(r'(?:^|/)val/val_annotations\.txt$', n)]
    if not train or not annotations:
      raise ConfigError(f'{where}: no train/<wnid>/images/*.JPEG or val/val_annotations.txt inside. Fix: give the '
                        f'original tiny-imagenet-200.zip ({SOURCES["tinyimagenet"].url}).')
    val_root = annotations[0][:-len('val_annotations.txt')]
    val = sorted((line.split('\t')[1], val_root + 'images/' + line.split('\t')[0])
                 for line in z.read(annotations[0]).decode().splitlines() if line.strip())
    classes = sorted({wnid for wnid, _ in train})
    index = {wnid: i for i, wnid in enumerate(classes)}
    unknown = sorted({wnid for wnid, _ in val} - set(index))
    if unknown:
      raise ConfigError(f'{where}: val/val_annotations.txt names classes without training images ({unknown[:3]}). '
                        f'Fix: download the original archive again.')
    arrays = {}
    for key, split in (('', train), ('_test', val)):
      out(f'  reading {len(split):,} {"training" if not key else "test"} images')
      arrays['x' + key] = _stack([_decode(z.read(n), f'{archive}:{n}') for _, n in split], where)
      arrays['y' + key] = np.asarray([index[wnid] for wnid, _ in split], np.int32)
  arrays['num_classes'] = np.asarray(len(classes))
  return arrays


CINIC10_CLASSES = ('airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog', 'horse', 'ship', 'truck')


def convert_cinic10(archive: str, out: Callable[[str], None] = print) -> dict[str, np.ndarray]:
  """The arrays of cinic10.npz from `CINIC-10.tar.gz`: x/y its train split, x_test/y_test its test split (90,000
  each); its valid split is left out. Labels follow CIFAR-10's class order (also the sorted folder names)."""
  where = f'{archive} (CINIC-10)'
  index = {c: i for i, c in enumerate(CINIC10_CLASSES)}
  splits = {'train': [], 'test': []}
  out('  reading the archive')
  with tarfile.open(archive, 'r:*') as tar:
    for member in tar:
      m = re.search(r'(?:^|/)(train|valid|test)/([a-z]+)/[^/]+\.png$', member.name)
      if not member.isfile() or not m or m.group(1) == 'valid':
        continue
      if m.group(2) not in index:
        raise ConfigError(f'{where}: unknown class folder {m.group(2)!r} ({member.name}); CINIC-10 has '
                          f'{", ".join(CINIC10_CLASSES)}. Fix: give the original archive.')
      splits[m.group(1)].append((member.name, index[m.group(2)],
                                 _decode(tar.extractfile(member).read(), f'{archive}:{member.name}')))
  if not splits['train'] or not splits['test']:
    raise ConfigError(f'{where}: no train/<class>/*.png and test/<class>/*.png inside. Fix: give the original '
                      f'CINIC-10.tar.gz ({SOURCES["cinic10"].url}).')
  arrays = {}
  for key, split in (('', 'train'), ('_test', 'test')):
    rows = sorted(splits[split], key=lambda r: r[0])
    out(f'  {len(rows):,} {split} images')
    arrays['x' + key] = _stack([r[2] for r in rows], where)
    arrays['y' + key] = np.asarray([r[1] for r in rows], np.int32)
  arrays['num_classes'] = np.asarray(len(CINIC10_CLASSES))
  return arrays


CONVERTERS = {'tinyimagenet': convert_tinyimagenet, 'cinic10': convert_cinic10}


def prepare_npz(source: Source, data_dir: str, archive: Optional[str] = None,
                out: Callable[[str], None] = print) -> str:
  """Writes DATA_DIR/NAME.npz from `archive` (default: DATA_DIR/downloads/ARCHIVE, downloaded when missing);
  returns its path. The .npz holds uint8 images, int32 labels and num_classes, what `load_npz` reads."""
  path = os.path.join(data_dir, f'{source.name}.npz')
  out(f'{source.name}: {source.description}')
  out(f'  download {format_size(source.download_bytes, source.approximate)}, prepared '
      f'{format_size(source.prepared_bytes)} -> {path}')
  if os.path.isfile(path):
    out(f'  already prepared ({format_size(os.path.getsize(path))}).')
  else:
    if archive is None:
      archive = os.path.join(data_dir, 'downloads', source.archive)
      if not os.path.isfile(archive):
        download(source.url, archive, source.name, data_dir, out)
    elif not os.path.isfile(archive):
      raise ConfigError(f'--archive={archive}: file not found. Fix: give the path of {source.archive} '
                        f'({source.url}).')
    arrays = CONVERTERS[source.name](archive, out)
    os.makedirs(data_dir, exist_ok=True)
    partial = path + '.part.npz'
    np.savez(partial, **arrays)
    os.replace(partial, path)
    out(f'  prepared: {format_size(os.path.getsize(path))} in {path} ({len(arrays["y"]):,} training and '
        f'{len(arrays["y_test"]):,} test images).')
  out(f'  use: --dataset=npz:{path}')
  return path


def prepare(names: Sequence[str], data_dir: Optional[str] = None, archive: Optional[str] = None,
            out: Callable[[str], None] = print) -> list[str]:
  """Prepares every dataset in `names` under `data_dir` (default `default_data_dir()`); returns their paths.

  Names are checked before anything is fetched. `archive`: a local copy of the original archive of the one
  non-tfds dataset named (Tiny-ImageNet's zip, CINIC-10's tar.gz), converted without network."""
  sources, notes = resolve_names(names)
  for note in notes:
    out(note)
  data_dir = os.path.abspath(os.path.expanduser(data_dir or default_data_dir()))
  if archive is not None:
    archived = [s.name for s in sources if not s.is_tfds]
    if len(archived) != 1 or len(sources) != 1:
      raise ConfigError(f'--archive={archive}: give it with exactly one of {", ".join(CONVERTERS)} (got '
                        f'{", ".join(s.name for s in sources) or "none"}).')
  return [prepare_tfds(s, data_dir, out) if s.is_tfds else prepare_npz(s, data_dir, archive, out) for s in sources]


def _help_table() -> str:
  """The datasets with their sizes, for --help."""
  width = max(map(len, SOURCES))
  lines = ['datasets (download / prepared size):']
  for s in SOURCES.values():
    sizes = f'{format_size(s.download_bytes, s.approximate)} / {format_size(s.prepared_bytes)}'
    lines.append(f'  {s.name:<{width}}  {sizes:<24}  {s.description}')
  lines.append(f'offline, nothing to prepare: {", ".join(OFFLINE_DATASETS)}, synthetic:H,W,C, npz:PATH.')
  return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """The command line; returns the exit status: 0; `EXIT_USAGE` (2) with one line on stderr for a bad option or an
  unknown name, before anything is fetched; `EXIT_FAILED` (1) with one line for a failed preparation."""
  try:
    return _main(argv)
  except ConfigError as e:  # the command line: an option, a value or a name
    sys.stderr.write(error_line(e) + '\n')
    return EXIT_USAGE


def _main(argv: Optional[Sequence[str]]) -> int:
  parser = argument_parser(prog=PREPARE_COMMAND, description=__doc__.split('\n\n', 1)[1],
                                   epilog=_help_table(), formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('names', nargs='*', metavar='NAME', help='datasets to prepare (listed below)')
  parser.add_argument('--data_dir', default=None, help=f'where the data go (default: $TFDS_DATA_DIR, else '
                      f'~/tensorflow_datasets); runs read it with --data_dir')
  parser.add_argument('--list', action='store_true', help='show what DATA_DIR holds already, and stop')
  parser.add_argument('--archive', default=None, help='a copy of the original archive of tinyimagenet or cinic10 '
                      '(no download)')
  args = parser.parse_args(argv)
  data_dir = os.path.abspath(os.path.expanduser(args.data_dir or default_data_dir()))
  if not args.list:
    if not args.names:
      raise ConfigError(f'name one or more datasets: {", ".join(SOURCES)}. Fix: {PREPARE_COMMAND} NAME ...; --help '
                        f'shows their sizes.')
    resolve_names(args.names)  # an unknown name: the command line's error, before anything is fetched
  try:
    if args.list:
      list_prepared(data_dir)
      return 0
    prepare(args.names, data_dir, args.archive)
  except ConfigError as e:
    sys.stderr.write(error_line(e) + '\n')
    return EXIT_FAILED
  return 0


if __name__ == '__main__':
  sys.exit(main())
