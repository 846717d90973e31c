"""The FedRE round as HtFLlib runs it, in PyTorch: the reference that benchmarks/vs_pytorch.py times against.

What a round does here, following HtFLlib's client/server loop (not its code):
  for each participating client, one after another in Python:
    [disk] load the client's model object from disk (HtFLlib's `load_item`)
    set its head to the global head (Alg. 1, line 6, of "FedRE: A Representation Entanglement Framework for
      Model-Heterogeneous Federated Learning", as fedjax_het does)
    build a shuffled DataLoader over its training rows (drop_last) and a fresh torch.optim.SGD
    run `epochs` epochs of CE steps
    eval-mode pass over its training rows -> representations; RAP weights -> one entangled (r~, y~)
    [disk] save the model object (HtFLlib's `save_item`)
  server: SGD on the global head over the uploaded rows (batch 10, summed soft-label CE), 1 epoch.

The model is HtFLlib's FedAvgCNN ("4-layer CNN"): conv32k5-pool-conv64k5-pool-fc512 -> head. RM with d = 512 on a
512-wide vector is the identity, as in fedjax_het's `cnn4`. `load_flax_params` copies a fedjax_het `cnn4`
initialisation into it, so both sides can start from the same weights (tests/test_torch_reference.py).

Optional dependency: `pip install -e '.[torch]'` (CPU or CUDA build from PyPI).
"""

from __future__ import annotations

import os
import tempfile
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TorchCNN4(nn.Module):
  """HtFLlib's FedAvgCNN(in_features=3, num_classes, dim=1600) split into extractor and head."""

  def __init__(self, in_channels: int = 3, num_classes: int = 10, width: int = 512, flat: int = 1600):
    super().__init__()
    self.conv1 = nn.Conv2d(in_channels, 32, 5)
    self.conv2 = nn.Conv2d(32, 64, 5)
    self.fc1 = nn.Linear(flat, width)
    self.head = nn.Linear(width, num_classes)

  def represent(self, x: torch.Tensor) -> torch.Tensor:
    x = F.max_pool2d(F.relu(self.conv1(x)), 2)
    x = F.max_pool2d(F.relu(self.conv2(x)), 2)
    return F.relu(self.fc1(torch.flatten(x, 1)))

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.head(self.represent(x))


def load_flax_params(model: TorchCNN4, params: dict) -> TorchCNN4:
  """Copies fedjax_het `cnn4` parameters (one client, NHWC/HWIO layout) into the PyTorch model (NCHW/OIHW)."""
  ext = params['extractor']
  t = lambda a: torch.from_numpy(np.array(a, np.float32))
  with torch.no_grad():
    for name, conv in (('Conv_0', model.conv1), ('Conv_1', model.conv2)):
      conv.weight.copy_(t(np.transpose(ext[name]['kernel'], (3, 2, 0, 1))))
      conv.bias.copy_(t(ext[name]['bias']))
    # Flax flattens (h, w, c); torch flattens (c, h, w).
    k = np.asarray(ext['Dense_0']['kernel'])
    channels = model.conv2.out_channels
    side = int(round((k.shape[0] // channels) ** 0.5))
    k = k.reshape(side, side, channels, -1).transpose(2, 0, 1, 3).reshape(k.shape[0], -1)
    model.fc1.weight.copy_(t(k.T))
    model.fc1.bias.copy_(t(ext['Dense_0']['bias']))
    model.head.weight.copy_(t(np.asarray(params['head']['kernel']).T))
    model.head.bias.copy_(t(params['head']['bias']))
  return model


def rap_weights(y: torch.Tensor, num_classes: int, generator: torch.Generator) -> torch.Tensor:
  """FedRE's RAP weights (Eq. 12): W_c = u_c / sum_present u, spread as W_c / n_c over class c's rows."""
  counts = torch.bincount(y, minlength=num_classes).float()
  u = torch.rand(num_classes, generator=generator, device=y.device) * (counts > 0)
  class_w = u / u.sum().clamp_min(1e-12)
  return (class_w / counts.clamp_min(1.0))[y]


class TorchFedRE:
  """K clients of TorchCNN4 and a global head, trained round by round in a Python loop.

  `train[k]` = (x [n_k, C, H, W] float32, y [n_k] int64) on `device`. `disk_io=True` keeps each client's model on
  disk between rounds, loading and saving it every round as HtFLlib does; otherwise models stay in memory.
  """

  def __init__(self, train: list[tuple[torch.Tensor, torch.Tensor]], num_classes: int, learning_rate: float,
               batch_size: int, epochs: int = 1, server_learning_rate: float = 0.01, server_batch_size: int = 10,
               disk_io: bool = False, device: str = 'cpu', seed: int = 0, eval_batch_size: int = 256,
               init_models: Optional[list[TorchCNN4]] = None):
    self.train, self.num_classes, self.device = train, num_classes, device
    self.lr, self.batch_size, self.epochs = learning_rate, batch_size, epochs
    self.server_lr, self.server_batch_size = server_learning_rate, server_batch_size
    self.eval_batch_size = eval_batch_size
    self.disk_io = disk_io
    torch.manual_seed(seed)
    self.generator = torch.Generator(device='cpu').manual_seed(seed)
    in_channels = train[0][0].shape[1]
    side = (train[0][0].shape[2] - 4) // 2
    flat = 64 * ((side - 4) // 2) ** 2
    models = init_models or [TorchCNN4(in_channels, num_classes, 512, flat) for _ in train]
    self.models = [m.to(device) for m in models]
    self.head = nn.Linear(512, num_classes).to(device)
    self.head.load_state_dict(self.models[0].head.state_dict())  # the global head starts as one client's
    self.steps = self.samples = 0
    if disk_io:
      self._dir = tempfile.TemporaryDirectory(prefix='torch_fedre_')
      for k, m in enumerate(self.models):
        torch.save(m, self._path(k))
      self.models = [None] * len(train)

  def _path(self, k: int) -> str:
    return os.path.join(self._dir.name, f'Client_{k}_model.pt')

  def _load(self, k: int) -> TorchCNN4:
    if self.disk_io:
      return torch.load(self._path(k), map_location=self.device, weights_only=False)
    return self.models[k]

  def _save(self, k: int, model: TorchCNN4) -> None:
    if self.disk_io:
      torch.save(model, self._path(k))

  def local_train(self, model: TorchCNN4, x: torch.Tensor, y: torch.Tensor,
                  batches: Optional[list[np.ndarray]] = None) -> list[float]:
    """Fresh SGD, `epochs` shuffled drop_last epochs of CE (or the given batches of row indices); returns the
    step losses."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=self.lr)
    if batches is None:
      loader = DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=True, drop_last=True,
                          generator=self.generator)
      batches_xy = (b for _ in range(self.epochs) for b in loader)
    else:
      batches_xy = ((x[torch.as_tensor(b)], y[torch.as_tensor(b)]) for b in batches)
    losses = []
    for xb, yb in batches_xy:
      opt.zero_grad()
      loss = F.cross_entropy(model(xb), yb)
      loss.backward()
      opt.step()
      losses.append(loss.item())
      self.steps += 1
      self.samples += len(yb)
    return losses

  @torch.no_grad()
  def represent(self, model: TorchCNN4, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    return torch.cat([model.represent(xb) for xb in torch.split(x, self.eval_batch_size)])

  def round(self) -> dict:
    """One FedRE round over all clients; returns the mean client loss and the server loss."""
    reps, labels, client_losses = [], [], []
    for k, (x, y) in enumerate(self.train):
      model = self._load(k)
      model.head.load_state_dict(self.head.state_dict())
      client_losses.append(np.mean(self.local_train(model, x, y) or [0.0]))
      r = self.represent(model, x)
      w = rap_weights(y.cpu(), self.num_classes, self.generator).to(r.device)
      reps.append(w @ r)
      labels.append(w @ F.one_hot(y, self.num_classes).float())
      self._save(k, model)
    server_loss = self.server_step(torch.stack(reps), torch.stack(labels))
    if self.device.startswith('cuda'):
      torch.cuda.synchronize()
    return {'train_loss': float(np.mean(client_losses)), 'server_loss': server_loss}

  def server_step(self, reps: torch.Tensor, soft: torch.Tensor) -> float:
    """Eq. 3: one epoch of SGD on the global head, summed soft-label CE over batches of uploaded rows."""
    opt = torch.optim.SGD(self.head.parameters(), lr=self.server_lr)
    total = 0.0
    for rb, sb in DataLoader(TensorDataset(reps, soft), batch_size=self.server_batch_size, shuffle=True,
                             generator=self.generator):
      opt.zero_grad()
      loss = -(sb * F.log_softmax(self.head(rb), -1)).sum()
      loss.backward()
      opt.step()
      total += loss.item()
    return total / max(len(reps), 1)


def client_tensors(x: np.ndarray, y: np.ndarray, n: np.ndarray, device: str = 'cpu'
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
  """fedjax_het's padded group arrays (x [K, n_max, H, W, C], y, n) -> per-client NCHW tensors of real rows."""
  return [(torch.from_numpy(np.ascontiguousarray(np.asarray(x[k, :n[k]]).transpose(0, 3, 1, 2))).to(device),
           torch.from_numpy(np.asarray(y[k, :n[k]]).astype(np.int64)).to(device)) for k in range(len(n))]
