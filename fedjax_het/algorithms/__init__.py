"""Federated methods as small sets of pure functions (see `base.Algorithm`)."""
from fedjax_het.algorithms.base import Algorithm, CommSpec
from fedjax_het.algorithms.ccvr import CCVRConfig, ccvr
from fedjax_het.algorithms.fd import FDConfig, fd
from fedjax_het.algorithms.fedavg import fedavg_grouped, group_fedavg
from fedjax_het.algorithms.fedgen import FedGenConfig, fedgen
from fedjax_het.algorithms.fedgh import FedGHConfig, fedgh
from fedjax_het.algorithms.fedkd import FedKDConfig, fedkd
from fedjax_het.algorithms.fedmrl import FedMRLConfig, fedmrl
from fedjax_het.algorithms.fedproto import FedProtoConfig, fedproto
from fedjax_het.algorithms.fedre import FedREConfig, entangle, entanglement_weights, fedre, train_head
from fedjax_het.algorithms.fedtgp import FedTGPConfig, fedtgp
from fedjax_het.algorithms.fml import FMLConfig, fml
from fedjax_het.algorithms.fpl import FPLConfig, fpl
from fedjax_het.algorithms.lg_fedavg import lg_fedavg
from fedjax_het.algorithms.local import local
