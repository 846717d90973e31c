"""Federated methods as small sets of pure functions (the API: `fedjax_het.core`; building blocks: `base`)."""
from fedjax_het.core import Algorithm, ClientProgram, Evaluation, Phase
from fedjax_het.methods.avgkd import AvgKDConfig, avgkd
from fedjax_het.methods.ccvr import CCVRConfig, ccvr
from fedjax_het.methods.fd import FDConfig, fd
from fedjax_het.methods.fedala import FedALAConfig, fedala
from fedjax_het.methods.fedavg import fedavg_grouped
from fedjax_het.methods.feddf import FedDFConfig, feddf
from fedjax_het.methods.fedgen import FedGenConfig, fedgen
from fedjax_het.methods.fedgh import FedGHConfig, fedgh
from fedjax_het.methods.fedgkt import FedGKTConfig, fedgkt
from fedjax_het.methods.fedkd import FedKDConfig, fedkd
from fedjax_het.methods.fedmd import FedMDConfig, fedmd
from fedjax_het.methods.fedmrl import FedMRLConfig, fedmrl
from fedjax_het.methods.fedproto import FedProtoConfig, fedproto
from fedjax_het.methods.fedprox import FedProxConfig, fedprox
from fedjax_het.methods.fedre import FedREConfig, entangle, entanglement_weights, fedre, train_head
from fedjax_het.methods.fedtgp import FedTGPConfig, fedtgp
from fedjax_het.methods.fedtype import FedTypeConfig, fedtype
from fedjax_het.methods.fedvtc import FedVTCConfig, fedvtc
from fedjax_het.methods.felo import FedHeConfig, FeloConfig, fedhe, felo
from fedjax_het.methods.fml import FMLConfig, fml
from fedjax_het.methods.fpl import FPLConfig, fpl
from fedjax_het.methods.gefl import GeFLConfig, gefl
from fedjax_het.methods.gefl_f import GeFLFConfig, gefl_f, lg_fedavg_first_block
from fedjax_het.methods.heterofl import HeteroFLConfig, heterofl
from fedjax_het.methods.lg_fedavg import lg_fedavg
from fedjax_het.methods.local import local
from fedjax_het.methods.pfedafm import PFedAFMConfig, pfedafm
from fedjax_het.methods.velo import VeloConfig, velo
