"""Local: every client trains on its own data with CE only; nothing is communicated (the FedRE baseline)."""

from __future__ import annotations

from fedjax_het.algorithms.base import (Algorithm, identity_broadcast, keep_client, keep_server, local_head,
                                        no_server, no_upload)
from fedjax_het.algorithms.common import cross_entropy_loss


def local(num_classes: int) -> Algorithm:
  """The Local baseline as an `Algorithm`."""
  return Algorithm('local', no_server, identity_broadcast, keep_client, cross_entropy_loss, no_upload, keep_server,
                   local_head, lambda spec: {'upload': {}, 'broadcast': {}}, needs_representations=False)
