"""The ten heterogeneous CNNs of GeFL ("GeFL: Model-Agnostic Federated Learning with Generative Models",
Tables XXI-XXIII), as extractors.

Every CNN starts with GeFL-F's common block (conv 3x3 to 3 channels, BN, ReLU, and for CIFAR-10 a conv to 10
channels with BN; 'cifar10f' is CIFAR-10 as GeFL's code builds it, without that conv(10), the CNNs GeFL-F's feature
generators fit) and continues with 1-4 further 3x3 conv -> [BN] -> ReLU -> maxpool 2x2 blocks whose widths differ
per CNN. The tables list the deeper blocks right-aligned: CNN-1 stops after the second block, CNN-2..4 after the
third, CNN-5..7 after the fourth, CNN-8..10 after the fifth. With 32x32 inputs the flattened features have the
widths of the tables' final fc layers (1024, 512, 640, 320, 256, 320, 160, 128, 100, 80), which is how the
alignment was checked. The extractor returns those flattened features [B, F]; the library's RM and head (F -> d ->
C) stand where GeFL has fc(F/C).
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp

from fedjax_het.models.layers import Conv
from fedjax_het.models.norm import TorchBatchNorm
from fedjax_het.models.pooling import max_pool

# Output channels per CNN-k (k = 1..10) of each block after the common one; None: the CNN has no such block.
SECOND_BLOCK = {'mnist': (16, 16, 20, 10, 16, 20, 10, 16, 20, 10), 'fmnist': (16, 16, 20, 10, 16, 20, 10, 16, 20, 10),
                'cifar10': (16, 16, 20, 10, 10, 20, 10, 16, 20, 10)}
SECOND_BLOCK['cifar10f'] = SECOND_BLOCK['cifar10']
THIRD_BLOCK = (None, 32, 40, 20, 32, 40, 20, 32, 40, 20)
FOURTH_BLOCK = (None,) * 4 + (64, 80, 40, 64, 80, 40)
FIFTH_BLOCK = (None,) * 7 + (128, 100, 80)
GEFL_DATASETS = tuple(SECOND_BLOCK)  # 'fmnist' covers Table XXII (FMNIST and SVHN)


def gefl_widths(dataset: str, k: int) -> tuple[int, ...]:
  """The widths of CNN-k's blocks after the common one, for Table XXI ('mnist'), XXII ('fmnist', also SVHN) or
  XXIII ('cifar10' and 'cifar10f')."""
  rows = (SECOND_BLOCK[dataset], THIRD_BLOCK, FOURTH_BLOCK, FIFTH_BLOCK)
  return tuple(row[k - 1] for row in rows if row[k - 1] is not None)


STAGES = ('all', 'features', 'header')
FE_PREFIX = 'fe_'  # the layers of the common block F (GeFL-F's shared extractor; the code's `avg_FE` block)


class GeFLCNN(nn.Module):
  """GeFL's CNN-k for `dataset` (see the module docstring); returns flattened features [B, F].

  stage: 'all' (image -> features), 'features' (image -> the common block's output, GeFL-F's shared feature
  extractor F: [B, 16, 16, 3] for 32x32 MNIST/FMNIST inputs) or 'header' (F's output -> features). The layers
  carry explicit names (F's start with 'fe_'), so one parameter tree serves all three stages."""
  dataset: str
  k: int
  conv: Any = Conv
  stage: str = 'all'

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    norm = lambda name: TorchBatchNorm(use_running_average=not train, name=name)
    pool = lambda h: max_pool(h, (2, 2), (2, 2))
    if self.stage != 'header':
      x = nn.relu(norm('fe_bn')(self.conv(3, (3, 3), padding=1, name='fe_conv')(x)))
      if self.dataset == 'cifar10':  # Table XXIII: a second common conv, pooled once after it
        x = pool(nn.relu(norm('fe_bn2')(self.conv(10, (3, 3), padding=1, name='fe_conv2')(x))))
      else:
        x = pool(x)
      if self.stage == 'features':
        return x
    bn_after: Optional[bool] = self.dataset == 'fmnist'  # Table XXII normalises every block, XXI/XXIII none
    for i, width in enumerate(gefl_widths(self.dataset, self.k)):
      x = self.conv(width, (3, 3), padding=1, name=f'conv{i}')(x)
      x = pool(nn.relu(norm(f'bn{i}')(x) if bn_after else x))
    return x.reshape(x.shape[0], -1)


def split_extractor(tree: dict) -> tuple[dict, dict]:
  """(F's part, the rest) of a params-like tree {'extractor': {...}, ...}: F's layers are the extractor's entries
  named 'fe_...'. A tree without 'extractor' is all rest."""
  if 'extractor' not in tree:
    return {}, tree
  fe = {k: v for k, v in tree['extractor'].items() if k.startswith(FE_PREFIX)}
  rest = {k: v for k, v in tree['extractor'].items() if not k.startswith(FE_PREFIX)}
  return fe, {**tree, 'extractor': rest}


def join_extractor(fe: dict, rest: dict) -> dict:
  """The inverse of `split_extractor`."""
  if not fe:
    return rest
  return {**rest, 'extractor': {**rest.get('extractor', {}), **fe}}


def split_client(params, model_state) -> tuple[dict, dict]:
  """({'params', 'stats'} of F, {'params', 'stats'} of the header) of a classifier's params and model_state."""
  fe_p, head_p = split_extractor(params)
  fe_s, head_s = split_extractor(model_state.get('batch_stats', {}))
  return {'params': fe_p, 'stats': fe_s}, {'params': head_p, 'stats': head_s}


def join_client(fe: dict, header: dict, model_state) -> tuple[dict, dict]:
  """(params, model_state) of a classifier assembled from F's and the header's parts."""
  params = join_extractor(fe['params'], header['params'])
  if 'batch_stats' not in model_state:
    return params, model_state
  return params, {**model_state, 'batch_stats': join_extractor(fe['stats'], header['stats'])}
