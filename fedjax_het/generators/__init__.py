"""Class-conditional generators that clients train federatedly (GeFL): DCGAN, CVAE and DDPM."""

from fedjax_het.generators.base import ConditionalGenerator, from_generator_range, to_generator_range
from fedjax_het.generators.cvae import cvae
from fedjax_het.generators.dcgan import dcgan
from fedjax_het.generators.ddpm import ddpm

GENERATORS = ('dcgan', 'cvae', 'ddpm')
