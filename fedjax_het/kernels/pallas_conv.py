"""A stride-1 2-D convolution as Pallas kernels (Triton on NVIDIA GPUs), batched over clients by `jax.vmap`.

Under vmap over clients each client has its own kernel. XLA then runs a grouped convolution (slow on GPUs), and
the im2col formulation (models/conv.py) writes every patch to memory: kh*kw times the input (25x for cnn4's 5x5
layers) before one batched matmul. These kernels compute the same sums without materialising patches (an implicit
GEMM): each program loads shifted rows of the padded input and multiplies them with the kernel's (i, j) slice,
accumulating in float32. `jax.vmap` of `pallas_call` adds the client axis to the launch grid, so a whole chunk of
clients is one launch per kernel.

  forward   out[n, y, x, o] = sum_{i, j, c} xp[n, y + i, x + j, c] * w[i, j, c, o]       (xp: x zero-padded)
  d_input   the forward kernel on the output gradient padded by (k - 1 - pad) with the kernel flipped in space
            and its channel axes swapped (the transpose of a stride-1 convolution)
  d_kernel  dw[i, j, c, o] = sum_{n, y, x} xp[n, y + i, x + j, c] * g[n, y, x, o]: one program per (i, j), a loop
            over the rows

Triton's tensors have power-of-2 sizes and its matmuls at least 16 rows, columns and depth, so channels are padded
to a power of 2 of at least 16 and each program computes `rows` output rows of a power-of-2 width; the padding is
zeros and is cropped (the padded output positions get zero gradient). With few input channels a row's kw taps are
laid side by side on the channel axis first (`folds_taps`: a kw-fold copy of the input, not im2col's kh*kw-fold),
so that the padded depth is not mostly zeros. Matmuls take `precision` as XLA's do: the default is TF32 on GPUs,
exact float32 elsewhere.

On any platform but a GPU the kernels run in Pallas's interpreter (`interpret=None`, decided when a program is
lowered for its platform), which is how the tests check them on the CPU, far slower than XLA's convolutions there;
`ExecutionConfig` allows conv='pallas' on GPUs only, and on one device (XLA cannot split a Pallas kernel over a
client mesh).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

MIN_DOT = 16  # Triton's smallest matmul side
TARGET_ROWS = 128  # a program's output positions (rows x padded width) where the shape allows
NUM_WARPS = 4
NUM_STAGES = 2

Pads = tuple[tuple[int, int], tuple[int, int]]


def _pow2(n: int, least: int = 1) -> int:
  p = least
  while p < n:
    p *= 2
  return p


def _launch(call, args, interpret: Optional[bool]) -> jax.Array:
  """call(interpret)(*args); interpret None: compiled on GPUs, Pallas's interpreter on other platforms, decided
  when the program is lowered for its platform (so a program lowered for a GPU on a CPU host gets the kernels)."""
  if interpret is not None:
    return call(interpret)(*args)
  return lax.platform_dependent(*args, cuda=call(False), rocm=call(False), default=call(True))


def block_rows(out_height: int, out_width: int) -> int:
  """Output rows per program: a power of 2 that makes the program's matmul at least MIN_DOT and at most about
  TARGET_ROWS positions tall, choosing the one that pads out_height least (then the larger)."""
  width = _pow2(out_width)
  smallest = _pow2(max(1, MIN_DOT // width))
  candidates = [smallest]
  while candidates[-1] * 2 * width <= TARGET_ROWS and candidates[-1] < out_height:
    candidates.append(candidates[-1] * 2)
  return min(candidates, key=lambda r: (-(-out_height // r) * r, -r))


class Tiling(NamedTuple):
  """How the kernels lay out a VALID stride-1 convolution to out_hw [Ho, Wo] for Triton: `taps` (kh, kw) of the
  kernel after folding (kw 1 where `folded`), matmul `depth` (input channels, times kw where folded, padded) and
  `columns` (output channels, padded), and `rows` output rows of `width` columns per program over `height` rows."""
  folded: bool
  taps: tuple[int, int]
  depth: int
  columns: int
  rows: int
  width: int
  height: int

  def macs(self, samples: int) -> int:
    """Multiply-adds the forward kernel (or the kernel gradient's) computes for `samples` inputs, padding
    included."""
    return samples * self.height * self.width * self.taps[0] * self.taps[1] * self.depth * self.columns


def tiling(channels: int, out_channels: int, kernel_hw: tuple[int, int], out_hw: tuple[int, int]) -> Tiling:
  """The kernels' layout of a convolution of `channels` to `out_channels` with a kernel_hw kernel onto out_hw."""
  (kh, kw), (out_height, out_width) = kernel_hw, out_hw
  folded = folds_taps(channels, kw)
  taps, depth = ((kh, 1), channels * kw) if folded else ((kh, kw), channels)
  rows = block_rows(out_height, out_width)
  return Tiling(folded, taps, _pow2(depth, MIN_DOT), _pow2(out_channels, MIN_DOT), rows, _pow2(out_width),
                -(-out_height // rows) * rows)


def _params():
  return pl_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def _dot(a, b, precision, contract_a: int = 1):
  return lax.dot_general(a, b, (((contract_a,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


def folds_taps(channels: int, kernel_width: int) -> bool:
  """Whether a row's kernel_width taps go side by side on the channel axis (a kernel_width-fold copy of the
  input) so that one matmul covers them: where that pads the matmul's depth less than `channels` alone, i.e. few
  channels (cnn4's first layer: 3 channels padded to 16, against 5 x 3 = 15 padded to 16)."""
  return kernel_width > 1 and _pow2(channels * kernel_width, MIN_DOT) < _pow2(channels, MIN_DOT) * kernel_width


def _fold_taps(xp, kernel_width: int, out_width: int) -> jax.Array:
  """xp [N, Hp, out_width + kw - 1, C] -> [N, Hp, out_width, kw * C]: column x holds xp's columns x .. x + kw - 1
  in (j, c) order, matching a kernel [kh, kw, C, O] reshaped to [kh, 1, kw * C, O]."""
  return jnp.concatenate([xp[:, :, j:j + out_width] for j in range(kernel_width)], axis=-1)


def _staged(xp, out_channels: int, kernel_hw: tuple[int, int], out_hw: tuple[int, int]) -> tuple[Tiling, jax.Array]:
  """The tiling of a VALID convolution of xp [N, Hp, Wp, C] onto out_hw, and xp zero-padded to it: the rows and
  columns every program reads, the channels to the matmul's depth."""
  t = tiling(xp.shape[-1], out_channels, kernel_hw, out_hw)
  (kh, kw), (_, hp, wp, c) = kernel_hw, xp.shape
  return t, jnp.pad(xp, ((0, 0), (0, t.height + kh - 1 - hp), (0, t.width + kw - 1 - wp), (0, t.depth - c)))


def _valid_conv(xp, w, out_height: int, out_width: int, precision, interpret: Optional[bool]) -> jax.Array:
  """The VALID stride-1 convolution of xp [N, Hp, Wp, C] with w [kh, kw, C, O], cropped to
  [N, out_height, out_width, O]; xp must already hold the convolution's padding."""
  n, c = xp.shape[0], xp.shape[-1]
  kh, kw, _, o = w.shape
  if folds_taps(c, kw):
    return _valid_conv(_fold_taps(xp, kw, out_width), w.reshape(kh, 1, kw * c, o), out_height, out_width,
                       precision, interpret)
  (_, _, cp, op, rows, width, height), xp = _staged(xp, o, (kh, kw), (out_height, out_width))
  w = jnp.pad(w, ((0, 0), (0, 0), (0, cp - c), (0, op - o)))

  def kernel(x_ref, w_ref, out_ref):
    top = pl.program_id(1) * rows
    acc = jnp.zeros((rows * width, op), jnp.float32)
    for i in range(kh):
      for j in range(kw):
        patch = x_ref[pl.ds(top + i, rows), pl.ds(j, width), :].reshape(rows * width, cp)
        acc += _dot(patch, w_ref[i, j], precision)
    out_ref[...] = acc.reshape(rows, width, op).astype(out_ref.dtype)

  call = lambda interpret: pl.pallas_call(
      kernel, grid=(n, height // rows),
      in_specs=[pl.BlockSpec((pl.Squeezed(),) + xp.shape[1:], lambda b, r: (b, 0, 0, 0)),
                pl.BlockSpec(w.shape, lambda b, r: (0, 0, 0, 0))],
      out_specs=pl.BlockSpec((pl.Squeezed(), rows, width, op), lambda b, r: (b, r, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((n, height, width, op), xp.dtype),
      interpret=interpret, compiler_params=_params(), name='conv_forward')
  out = _launch(call, (xp, w), interpret)
  return out[:, :out_height, :out_width, :o]


def _kernel_gradient(xp, g, kernel_hw: tuple[int, int], precision, interpret: Optional[bool]) -> jax.Array:
  """dw [kh, kw, C, O] = sum over samples and output positions of xp's shifted patch times g [N, Ho, Wo, O]."""
  n, c = xp.shape[0], xp.shape[-1]
  _, out_height, out_width, o = g.shape
  kh, kw = kernel_hw
  if folds_taps(c, kw):
    folded = _kernel_gradient(_fold_taps(xp, kw, out_width), g, (kh, 1), precision, interpret)
    return folded.reshape(kh, kw, c, o)
  (_, _, cp, op, rows, width, height), xp = _staged(xp, o, (kh, kw), (out_height, out_width))
  blocks = height // rows
  g = jnp.pad(g, ((0, 0), (0, height - out_height), (0, width - out_width), (0, op - o)))  # zeros: no gradient

  def kernel(x_ref, g_ref, out_ref):
    i, j = pl.program_id(0), pl.program_id(1)

    def add(t, acc):
      count = jnp.int32(blocks)  # a typed constant: Triton's lowering of `t % 1` with a Python int fails
      sample, top = lax.div(t, count), lax.rem(t, count) * rows
      patch = x_ref[sample, pl.ds(top + i, rows), pl.ds(j, width), :].reshape(rows * width, cp)
      grad = g_ref[sample, pl.ds(top, rows), :, :].reshape(rows * width, op)
      return acc + _dot(patch, grad, precision, contract_a=0)

    out_ref[...] = lax.fori_loop(0, n * blocks, add, jnp.zeros((cp, op), jnp.float32)).astype(out_ref.dtype)

  call = lambda interpret: pl.pallas_call(
      kernel, grid=(kh, kw),
      in_specs=[pl.BlockSpec(xp.shape, lambda i, j: (0, 0, 0, 0)),
                pl.BlockSpec(g.shape, lambda i, j: (0, 0, 0, 0))],
      out_specs=pl.BlockSpec((pl.Squeezed(), pl.Squeezed(), cp, op), lambda i, j: (i, j, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((kh, kw, cp, op), jnp.float32),
      interpret=interpret, compiler_params=_params(), name='conv_kernel_gradient')
  dw = _launch(call, (xp, g), interpret)
  return dw[:, :, :c, :o]


def _pad_input(x, padding: Pads) -> jax.Array:
  return jnp.pad(x, ((0, 0),) + tuple(padding) + ((0, 0),))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _conv(x, w, padding: Pads, precision, interpret: Optional[bool]):
  kh, kw = w.shape[:2]
  out_height = x.shape[1] + sum(padding[0]) - kh + 1
  out_width = x.shape[2] + sum(padding[1]) - kw + 1
  return _valid_conv(_pad_input(x, padding), w, out_height, out_width, precision, interpret)


def _conv_fwd(x, w, padding, precision, interpret):
  return _conv(x, w, padding, precision, interpret), (x, w)


def _conv_bwd(padding, precision, interpret, residuals, g):
  x, w = residuals
  kh, kw = w.shape[:2]
  g = g.astype(x.dtype)
  # The input gradient is a VALID convolution of g padded by (k - 1 - pad) (negative: cropped) with the kernel
  # flipped in space and its channel axes swapped.
  (top, bottom), (left, right) = padding
  g_full = lax.pad(g, jnp.zeros((), g.dtype), ((0, 0, 0), (kh - 1 - top, kh - 1 - bottom, 0),
                                               (kw - 1 - left, kw - 1 - right, 0), (0, 0, 0)))
  w_transposed = jnp.flip(w, (0, 1)).transpose(0, 1, 3, 2)
  dx = _valid_conv(g_full, w_transposed.astype(x.dtype), x.shape[1], x.shape[2], precision, interpret)
  dw = _kernel_gradient(_pad_input(x, padding), g, (kh, kw), precision, interpret)
  return dx.astype(x.dtype), dw.astype(w.dtype)


_conv.defvjp(_conv_fwd, _conv_bwd)


def conv2d(x: jax.Array, w: jax.Array, padding: Sequence[Sequence[int]], precision=None,
           interpret: Optional[bool] = None) -> jax.Array:
  """The stride-1, undilated convolution of x [N, H, W, C] with w [kh, kw, C, O] after zero-padding H and W by
  `padding` ((top, bottom), (left, right), each >= 0): [N, H', W', O], as `lax.conv_general_dilated` with NHWC/HWIO
  dimension numbers computes it. Reverse-mode differentiable in x and w (a custom VJP of the same kernels); under
  `jax.vmap` one launch per kernel covers the batch. interpret: run Pallas's interpreter (None: on any platform
  but a GPU, decided when the program is lowered)."""
  pads = tuple((int(lo), int(hi)) for lo, hi in padding)
  if x.ndim != 4 or w.ndim != 4 or x.shape[-1] != w.shape[2] or len(pads) != 2 or min(min(pads)) < 0:
    raise ValueError(f'pallas_conv.conv2d: x {x.shape} [N, H, W, C], w {w.shape} [kh, kw, C, O] and padding '
                     f'{padding} ((top, bottom), (left, right), >= 0) do not describe a 2-D convolution. Fix: pass '
                     'channels-last arrays with matching C and non-negative padding.')
  return _conv(x, w, pads, precision, interpret)
