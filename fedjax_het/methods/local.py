"""Local: every client trains on its own data with CE only; nothing is communicated (the FedRE baseline)."""

from __future__ import annotations

from fedjax_het.core import Capabilities
from fedjax_het.methods.shared.base import (Algorithm, keep_server, local_head_evaluation, no_server, one_phase,
                                            sgd_program)
from fedjax_het.methods.shared.common import cross_entropy_loss


def local(num_classes: int) -> Algorithm:
  """The Local baseline as an `Algorithm`."""
  client = lambda group: sgd_program(cross_entropy_loss(group.model), group.training)
  return one_phase('local', no_server, client, keep_server, local_head_evaluation,
                   capabilities=Capabilities(partial_batches=True, shares_representations=False))
