"""Parameter counts of the registered architectures (no weights are materialised: shapes only).

  python experiments/model_zoo.py --image_size=32 --channels=3 --num_classes=10 --feature_dim=512
  python experiments/model_zoo.py --models=HtM-img-10

Columns: total (extractor + RM + head), extractor (the torchvision/HtFLlib backbone without its classifier),
head (d -> C), and the extractor's output width L before RM.
"""


import jax
import jax.numpy as jnp
import numpy as np
from fedjax_het.run import cli  # noqa: E402
from absl import flags

from fedjax_het.errors import ConfigError
from fedjax_het.models.registry import build_model, expand_models, model_names

flags.DEFINE_list('models', None, 'Architectures or families (default: every registered architecture).')
flags.DEFINE_integer('image_size', 32, 'Square input size.')
flags.DEFINE_integer('channels', 3, 'Input channels.')
flags.DEFINE_integer('num_classes', 10, 'Classes C.')
flags.DEFINE_integer('feature_dim', 512, 'Representation width d.')
FLAGS = flags.FLAGS


def count(tree) -> int:
  return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(tree))


def main(argv):
  names = expand_models(FLAGS.models) if FLAGS.models else tuple(model_names())
  x = jnp.zeros((1, FLAGS.image_size, FLAGS.image_size, FLAGS.channels))
  print(f'{"model":<18} {"total":>12} {"extractor":>12} {"head":>8} {"L":>6}')
  for name in names:
    try:
      model = build_model(name, FLAGS.num_classes, FLAGS.feature_dim)
      params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), x))['params']
      width = jax.eval_shape(lambda: model.extractor.init_with_output(jax.random.PRNGKey(0), x))[0].shape[-1]
    except ConfigError as e:
      raise
    except Exception as e:  # an architecture that cannot take this image size
      print(f'{name:<18} cannot take {FLAGS.image_size}x{FLAGS.image_size}x{FLAGS.channels} images '
            f'({type(e).__name__})')
      continue
    print(f'{name:<18} {count(params):>12,} {count(params["extractor"]):>12,} {count(params["head"]):>8,} '
          f'{width:>6}')


if __name__ == '__main__':
  cli.app_run(main)
