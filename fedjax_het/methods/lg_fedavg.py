"""LG-FedAvg (Liang et al. 2020, as run in HtFLlib): local extractors, a global head.

Each round a participant sets its head to the global head, trains its whole model on CE, and uploads its head; the
server averages the heads weighted by the participants' training-sample counts and broadcasts the average.
"""

from __future__ import annotations

from fedjax_het.core import Capabilities, UploadPrivacy
from fedjax_het.methods.shared.base import (Algorithm, HeadServer, HeadUpload, global_head_evaluation, initial_head,
                                            one_phase, receive_head, sgd_program)
from fedjax_het.methods.shared.common import cross_entropy_loss


def upload_head(client, rows, broadcast, key) -> HeadUpload:
  """The client's trained head."""
  return HeadUpload(client.params['head'])


def lg_fedavg(num_classes: int) -> Algorithm:
  """LG-FedAvg as an `Algorithm`."""

  def client(group):
    return sgd_program(cross_entropy_loss(group.model), group.training, receive=receive_head, upload=upload_head)

  def server_update(server, uploads, key):
    """head = sum_k n_k head_k / sum_k n_k over participants (kept when nobody participated)."""
    return HeadServer(uploads.mean('head', by='rows', previous=server.head)), {}

  # DP: the head's delta from the global head is clipped; the server averages the heads of all participants
  return one_phase('lg_fedavg', initial_head, client, server_update, global_head_evaluation,
                   capabilities=Capabilities(partial_batches=True),
                   upload_privacy=UploadPrivacy(reference=lambda b: {'head': b.head}, aggregate='sum',
                                                hides_participants=True))
