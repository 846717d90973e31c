"""BatchNorm with PyTorch's defaults, shared by every model ported from PyTorch."""

from __future__ import annotations

import functools

import flax.linen as nn

# torch BatchNorm: momentum 0.1 (flax's momentum is the complement, 0.9), eps 1e-5 (googlenet overrides 1e-3).
TorchBatchNorm = functools.partial(nn.BatchNorm, momentum=0.9, epsilon=1e-5)
