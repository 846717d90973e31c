"""oneDNN's convolution on the CPU as XLA custom calls: the kernels PyTorch's CPU convolutions run on.

XLA:CPU's convolutions take 1.4 to 8 times as long as oneDNN's on the 4-layer CNN's layers
(docs/performance.md). `onednn_conv.cc` wraps oneDNN's forward, input-gradient and kernel-gradient convolutions
as XLA FFI handlers; on first use this module compiles it with the system's C++ compiler against the oneDNN of
the `onednn` extra (`pip install -e '.[onednn]'`, Linux x86-64; or any oneDNN 3.x found through $DNNLROOT),
keeps the shared library in ~/.cache/fedjax_het/onednn (keyed by the source, the compiler and its flags, JAX's
version and the oneDNN files found) and registers the handlers with JAX. oneDNN must be built with OpenMP (the
extra's is): each call sets its OpenMP threads and puts the caller's setting back.

`conv2d` computes a 2-D channels-last float32 convolution with any strides, zero padding and kernel dilation
(`models.conv.onednn_conv_general_dilated` gives it lax's signature and sends the rest to lax). The three passes
are each other's adjoints, so it has reverse-mode derivatives of every order (`jax.grad` of `jax.grad`); forward
mode (`jax.jvp`) is not defined. Under `jax.vmap` each batched call loops over the mapped axis.

oneDNN parallelises each call with OpenMP; `set_threads` fixes its threads per call for the whole process (a
`Federation` sets `ExecutionConfig.onednn_threads` when it is built: by default the cores divided among its client
threads, so that two client threads on two cores run one single-threaded convolution each). For a fixed thread
count the results are the same run after run, whatever thread calls.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from fedjax_het.errors import ConfigError

SOURCE = os.path.join(os.path.dirname(__file__), 'onednn_conv.cc')
CACHE = os.path.join('~', '.cache', 'fedjax_het', 'onednn')
INSTALL = "pip install -e '.[onednn]' (Linux x86-64), or set DNNLROOT to a oneDNN 3.x installation"
_TEMPORARY: set = set()  # folders made for one process's build, removed once it is loaded
_TARGETS = {'forward': 'fedjax_het_onednn_conv_forward', 'input_gradient': 'fedjax_het_onednn_conv_input_gradient',
            'kernel_gradient': 'fedjax_het_onednn_conv_kernel_gradient'}


class OneDNNUnavailable(ConfigError):
  """oneDNN's convolutions cannot be used here; the message says why and how to fix it."""


def find_onednn(roots: Optional[Sequence[str]] = None) -> tuple[str, str]:
  """(include folder, libdnnl.so.3) of the first oneDNN 3.x under `roots` (default: $DNNLROOT, this Python's
  prefix, where the `onednn` extra's wheels put it, /usr/local, /usr). Raises OneDNNUnavailable."""
  if roots is None:
    roots = [r for r in (os.environ.get('DNNLROOT'), sys.prefix, sys.base_prefix, '/usr/local', '/usr') if r]
  for root in dict.fromkeys(roots):
    header = os.path.join(root, 'include', 'oneapi', 'dnnl', 'dnnl.hpp')
    libs = [os.path.join(root, d, 'libdnnl.so.3') for d in ('lib', 'lib64', 'lib/x86_64-linux-gnu')]
    lib = next((p for p in libs if os.path.exists(p)), None)
    if os.path.exists(header) and lib:
      return os.path.dirname(os.path.dirname(os.path.dirname(header))), lib
  raise OneDNNUnavailable(f'oneDNN 3.x was not found (looked for include/oneapi/dnnl/dnnl.hpp and lib/libdnnl.so.3 '
                          f'under {", ".join(dict.fromkeys(roots))}). Fix: {INSTALL}.')


def _compiler() -> str:
  names = [n for n in (os.environ.get('CXX'), 'c++', 'g++', 'clang++') if n]
  compiler = next((path for path in map(shutil.which, names) if path), None)
  if not compiler:
    raise OneDNNUnavailable('no C++ compiler was found to build the oneDNN convolution handlers (looked for $CXX, '
                            'c++, g++, clang++). Fix: install one (e.g. apt-get install g++), or use '
                            '--conv=auto.')
  return compiler


def build(include: str, lib: str, cache: str = CACHE) -> str:
  """The shared library of onednn_conv.cc compiled against oneDNN (`include`, `lib`), from `cache` when it was
  built before from the same source, compiler, flags, JAX and oneDNN files and is whole (its size and SHA-256 as
  written beside it when it was built; the compiler's command and warnings in <library>.log). A damaged cached
  library is rebuilt, an unfinished build left by a process that no longer runs is removed, and an unwritable
  cache folder builds into a temporary folder (`load` removes it once the library is loaded); each says so in one
  line. Raises OneDNNUnavailable when it fails to build."""
  compiler = _compiler()
  # JAX's and oneDNN's headers as system headers: the warnings of -Wall are then this source's own
  flags = ['-O2', '-std=c++17', '-shared', '-fPIC', '-Wall', '-isystem', jax.ffi.include_dir(), '-isystem', include]
  with open(SOURCE, 'rb') as f:
    source = f.read()
  found = [os.path.join(include, 'oneapi', 'dnnl', 'dnnl.hpp'), lib]
  stamps = [f'{os.path.realpath(p)}:{os.stat(p).st_size}:{os.stat(p).st_mtime_ns}' for p in found]
  key = hashlib.sha256(b'\0'.join([source, compiler.encode(), ' '.join(flags).encode(), jax.__version__.encode(),
                                   *[stamp.encode() for stamp in stamps]])).hexdigest()[:16]
  folder = _writable_folder(os.path.expanduser(cache))
  target = os.path.join(folder, f'onednn_conv_{key}.so')
  _remove_abandoned_builds(folder)
  if os.path.exists(target):
    damage = _damage(target)
    if damage is None:
      return target
    logging.warning('oneDNN: the cached convolution handlers %s are damaged (%s); building them again.', target,
                    damage)
    try:
      os.remove(target)
    except OSError:
      folder = _private_folder()
      target = os.path.join(folder, os.path.basename(target))
  partial = f'{target}.{os.getpid()}.{threading.get_ident()}.tmp'
  command = [compiler, *flags, SOURCE, lib, f'-Wl,-rpath,{os.path.dirname(lib)}', '-o', partial]
  try:
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode:
      lines = done.stderr.splitlines()
      errors = [line for line in lines if 'error' in line][:8] or lines[-8:]
      raise OneDNNUnavailable(f'building the oneDNN convolution handlers failed:\n  {" ".join(command)}\n'
                              + '\n'.join(errors) + f'\nFix: use --conv=auto, or a oneDNN 3.x ({INSTALL}).')
    with open(target + '.log', 'w') as f:  # the compiler's warnings, if any, beside the library
      f.write(' '.join(command) + '\n' + done.stderr)
    if done.stderr.strip():
      logging.warning('oneDNN: the convolution handlers built with warnings: %s.log', target)
    with open(partial + '.sha256', 'w') as f:
      f.write(_fingerprint(partial))
    # The fingerprint first: a library in place always has one (another process building the same file at once
    # may leave a pair that does not match, which the next start rebuilds).
    os.replace(partial + '.sha256', target + '.sha256')
    os.replace(partial, target)
  except (OSError, subprocess.TimeoutExpired) as e:
    raise OneDNNUnavailable(f'building the oneDNN convolution handlers failed ({e}). Fix: use --conv=auto.') from e
  finally:
    for leftover in (partial, partial + '.sha256'):
      if os.path.exists(leftover):
        os.remove(leftover)
  return target


def _fingerprint(path: str) -> str:
  """'<sha256> <size>' of a file."""
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  return f'{digest.hexdigest()} {os.path.getsize(path)}'


def _damage(target: str) -> Optional[str]:
  """None where the cached library `target` is whole (its fingerprint as written beside it), else what is wrong."""
  try:
    with open(target + '.sha256') as f:
      expected = f.read().strip()
  except OSError:
    return 'no fingerprint beside it to check it by'
  try:
    actual = _fingerprint(target)
  except OSError as e:
    return f'unreadable: {e.strerror}'
  if actual != expected:
    size, want = actual.split()[1], expected.split()[-1]
    return f'{size} bytes where {want} were written' if size != want else 'its contents changed'
  return None


def _private_folder() -> str:
  folder = tempfile.mkdtemp(prefix='fedjax_het_onednn_')
  _TEMPORARY.add(folder)
  return folder


def _writable_folder(folder: str) -> str:
  """`folder`, created if needed; a temporary one (one line says so) where it cannot be written."""
  try:
    os.makedirs(folder, exist_ok=True)
    if os.access(folder, os.W_OK | os.X_OK):
      return folder
  except OSError:
    pass
  logging.warning('oneDNN: the cache folder %s cannot be written; the convolution handlers are built in a '
                  'temporary folder for this process (make the folder writable to build them once).', folder)
  return _private_folder()


def _remove_abandoned_builds(folder: str) -> None:
  """Removes the unfinished builds (`*.so.<pid>.<thread>.tmp`) of processes that no longer run."""
  for name in os.listdir(folder):
    parts = name.split('.')
    if not (name.startswith('onednn_conv_') and name.endswith('.tmp') and len(parts) >= 5 and parts[-3].isdigit()):
      continue
    pid = int(parts[-3])
    try:
      os.kill(pid, 0)
      continue  # a build under way
    except ProcessLookupError:
      pass
    except OSError:  # another user's process: not ours to judge
      continue
    try:
      os.remove(os.path.join(folder, name))
      logging.warning('oneDNN: removed %s, a build left unfinished by process %d.', os.path.join(folder, name), pid)
    except OSError:
      pass


@functools.lru_cache(maxsize=None)
def load() -> ctypes.CDLL:
  """The compiled handlers, registered with JAX for the CPU (built on first call). Raises OneDNNUnavailable."""
  if not hasattr(getattr(jax, 'ffi', None), 'include_dir'):
    raise OneDNNUnavailable(f'JAX {jax.__version__} has no jax.ffi to call oneDNN with. Fix: pip install -U jax, or '
                            f'use --conv=auto.')
  path = build(*find_onednn())
  try:
    library = ctypes.CDLL(path)
    if os.path.dirname(path) in _TEMPORARY:  # loaded: the file can go (the mapping stays)
      shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    for target in _TARGETS.values():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, target)), platform='cpu')
    library.fedjax_het_onednn_version.restype = ctypes.c_char_p
  except (OSError, AttributeError, ValueError, RuntimeError) as e:  # e.g. a oneDNN built without OpenMP
    raise OneDNNUnavailable(f'loading the oneDNN convolution handlers ({path}) failed: {e}. Fix: use --conv=auto, '
                            f'or a oneDNN 3.x built with OpenMP ({INSTALL}).') from e
  return library


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> Optional[str]:
  """None when oneDNN's convolutions can run here, else why not (with its fix); decided once per process."""
  try:
    load()
  except OneDNNUnavailable as e:
    return str(e)
  return None


def version() -> str:
  """The loaded oneDNN's version, e.g. '3.2.0'."""
  return load().fedjax_het_onednn_version().decode()


def set_threads(threads: int) -> None:
  """OpenMP threads of each oneDNN convolution from now on, in every calling thread (0: OpenMP's default); at
  most the machine's cores."""
  cores = os.cpu_count() or 1
  if not 0 <= int(threads) <= cores:
    raise ConfigError(f'onednn.set_threads({threads}): between 0 (OpenMP\'s default) and this machine\'s {cores} '
                      f'cores. Fix: a thread count in that range.')
  load().fedjax_het_onednn_set_threads(int(threads))


def _call(pass_: str, shape, a, b, geometry):
  strides, padding, dilation, groups = geometry
  return jax.ffi.ffi_call(_TARGETS[pass_], jax.ShapeDtypeStruct(shape, jnp.float32), vmap_method='sequential')(
      a, b, strides=np.asarray(strides, np.int64), padding=np.asarray([p for pair in padding for p in pair], np.int64),
      dilation=np.asarray(dilation, np.int64), groups=np.int64(groups))


def _output_shape(x_shape, w_shape, geometry):
  strides, padding, dilation, _ = geometry
  spatial = [max(0, (x_shape[1 + a] + sum(padding[a]) - (w_shape[a] - 1) * dilation[a] - 1) // strides[a] + 1)
             for a in range(2)]  # empty where the window is larger than the padded input, as lax's
  return (x_shape[0], *spatial, w_shape[3])


# The three passes are bilinear and each other's adjoints: with y = F(x, w), D(dy, w) its input gradient and
# K(x, dy) its kernel gradient, <F(x, w), dy> = <x, D(dy, w)> = <w, K(x, dy)>; each one's VJP is the other two.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _forward(x, w, geometry):
  return _call('forward', _output_shape(x.shape, w.shape, geometry), x, w, geometry)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _input_gradient(dy, w, x_shape, geometry):
  return _call('input_gradient', x_shape, dy, w, geometry)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _kernel_gradient(x, dy, w_shape, geometry):
  return _call('kernel_gradient', w_shape, x, dy, geometry)


_forward.defvjp(
    lambda x, w, geometry: (_forward(x, w, geometry), (x, w)),
    lambda geometry, res, g: (_input_gradient(g, res[1], res[0].shape, geometry),
                              _kernel_gradient(res[0], g, res[1].shape, geometry)))
_input_gradient.defvjp(
    lambda dy, w, x_shape, geometry: (_input_gradient(dy, w, x_shape, geometry), (dy, w)),
    lambda x_shape, geometry, res, g: (_forward(g, res[1], geometry),
                                       _kernel_gradient(g, res[0], res[1].shape, geometry)))
_kernel_gradient.defvjp(
    lambda x, dy, w_shape, geometry: (_kernel_gradient(x, dy, w_shape, geometry), (x, dy)),
    lambda w_shape, geometry, res, g: (_input_gradient(res[1], g, res[0].shape, geometry),
                                       _forward(res[0], g, geometry)))


def conv2d(x: jax.Array, w: jax.Array, strides: Sequence[int], padding: Sequence[tuple[int, int]],
           dilation: Sequence[int], groups: int = 1) -> jax.Array:
  """out[n, y, x, o] = sum_{i, j, c} x_pad[n, y*s + i*d, x*s + j*d, g*C/G + c] * w[i, j, c, o] with g = o // (O/G)
  by oneDNN, for float32 x [N, H, W, C] and w [KH, KW, C/G, O] (G `groups`, lax's feature_group_count; depthwise
  when G = C), (low, high) zero padding per spatial axis (not negative) and kernel dilation d; differentiable in
  reverse mode to every order. Raises OneDNNUnavailable (with its fix) when oneDNN cannot be loaded.
  `models.conv.onednn_conv_general_dilated` is the same with lax's signature."""
  load()
  if groups < 1 or x.shape[-1] != w.shape[2] * groups or w.shape[3] % groups:
    raise ValueError(f'onednn.conv2d: input channels {x.shape[-1]} must be the kernel\'s {w.shape[2]} times groups '
                     f'{groups}, and output channels {w.shape[3]} a multiple of the groups. Fix: a kernel [KH, KW, '
                     f'C / groups, O] with O a multiple of groups.')
  geometry = (tuple(int(s) for s in strides), tuple((int(lo), int(hi)) for lo, hi in padding),
              tuple(int(d) for d in dilation), int(groups))
  return _forward(x, w, geometry)
