"""Federated methods as small sets of pure functions (the API: `fedjax_het.core`; building blocks: `base`)."""
from fedjax_het.algorithms.avgkd import AvgKDConfig, avgkd
from fedjax_het.algorithms.ccvr import CCVRConfig, ccvr
from fedjax_het.algorithms.fd import FDConfig, fd
from fedjax_het.algorithms.fedavg import fedavg_grouped
from fedjax_het.algorithms.fedala import FedALAConfig, fedala
from fedjax_het.algorithms.feddf import FedDFConfig, feddf
from fedjax_het.algorithms.felo import FedHeConfig, FeloConfig, fedhe, felo
from fedjax_het.algorithms.fedgen import FedGenConfig, fedgen
from fedjax_het.algorithms.fedgkt import FedGKTConfig, fedgkt
from fedjax_het.algorithms.fedprox import FedProxConfig, fedprox
from fedjax_het.algorithms.gefl import GeFLConfig, gefl
from fedjax_het.algorithms.heterofl import HeteroFLConfig, heterofl
from fedjax_het.algorithms.gefl_f import GeFLFConfig, gefl_f, lg_fedavg_first_block
from fedjax_het.algorithms.fedgh import FedGHConfig, fedgh
from fedjax_het.algorithms.fedkd import FedKDConfig, fedkd
from fedjax_het.algorithms.fedmd import FedMDConfig, fedmd
from fedjax_het.algorithms.fedmrl import FedMRLConfig, fedmrl
from fedjax_het.algorithms.fedproto import FedProtoConfig, fedproto
from fedjax_het.algorithms.fedre import FedREConfig, entangle, entanglement_weights, fedre, train_head
from fedjax_het.algorithms.fedtgp import FedTGPConfig, fedtgp
from fedjax_het.algorithms.fedtype import FedTypeConfig, fedtype
from fedjax_het.algorithms.fedvtc import FedVTCConfig, fedvtc
from fedjax_het.algorithms.fml import FMLConfig, fml
from fedjax_het.algorithms.fpl import FPLConfig, fpl
from fedjax_het.algorithms.lg_fedavg import lg_fedavg
from fedjax_het.algorithms.pfedafm import PFedAFMConfig, pfedafm
from fedjax_het.algorithms.local import local
from fedjax_het.algorithms.velo import VeloConfig, velo
from fedjax_het.core import Algorithm, ClientProgram, Evaluation, Phase
