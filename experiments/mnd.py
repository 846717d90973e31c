"""The memorisation ratio (MND, "GeFL: Model-Agnostic Federated Learning with Generative Models", Eq. 1) of a
finished run's generator: its latest checkpoint's server generator draws --per_class images per class (S), --points
random training images x_i of the run's clients are compared with S and with as many held-out test images (V), and
mean_i min_V d / min_S d is printed and written to <workdir>/mnd.json for each --distances entry
(fedjax_het/evaluation/mnd.py). For GeFL-F, whose generator draws feature maps, S is the images recovered from them by
inversion through the run's frozen extractor F (`mnd.gefl_f_synthetic_images`; --inversion_steps, --inversion_lr,
--tv_weight).

  python experiments/mnd.py --workdir=/tmp/gefl_mnist5k --distances=pixel,feature
"""

import json
import os

from fedjax_het.run import cli  # noqa: E402
from absl import flags

from fedjax_het.run.compilation_cache import DEFAULT_DIRECTORY, use_compilation_cache

flags.DEFINE_string('workdir', None, 'A finished (or checkpointed) run of a method with a generator, e.g. GeFL.')
flags.DEFINE_list('distances', ['pixel', 'feature'], 'Distances d: pixel (L2 of images), feature (L2 of a fixed '
                  'random small_cnn\'s features).')
flags.DEFINE_integer('points', 1000, 'Training points x_i (the paper: 1000).')
flags.DEFINE_integer('per_class', 60, 'Generated images per class in S (|S| = |V| = per_class x classes; the paper '
                     'gives |S| = 600).')
flags.DEFINE_integer('seed', 0, 'Seed of the draws.')
flags.DEFINE_integer('inversion_steps', 500, 'GeFL-F: Adam steps inverting each generated feature map through F.')
flags.DEFINE_float('inversion_lr', 0.05, 'GeFL-F: Adam rate of the inversion.')
flags.DEFINE_float('tv_weight', 0.1, 'GeFL-F: total-variation weight of the inversion.')
flags.DEFINE_string('compilation_cache', DEFAULT_DIRECTORY, 'Folder of XLA\'s persistent compilation cache (as in '
                    'experiments/run.py); empty: off.')
flags.mark_flag_as_required('workdir')
FLAGS = flags.FLAGS


def main(argv):
  import jax
  import numpy as np
  from fedjax_het.errors import ConfigError
  from fedjax_het.run.experiment import restore_run
  from fedjax_het.evaluation import embedding, mnd_ratio
  use_compilation_cache(FLAGS.compilation_cache)
  try:
    cfg, fed, state = restore_run(FLAGS.workdir)
    if fed.algorithm.samples is None and cfg.algorithm != 'gefl_f':
      raise ConfigError(f'--workdir: {cfg.algorithm} has no generator to sample from (GeFL, GeFL-F, FedVTC have '
                        f'one).')
  except ConfigError as e:
    raise
  key = jax.random.PRNGKey(FLAGS.seed)
  if cfg.algorithm == 'gefl_f':
    from fedjax_het.evaluation.mnd import gefl_f_synthetic_images
    from fedjax_het.evaluation import InversionConfig
    try:
      inversion = InversionConfig(steps=FLAGS.inversion_steps, learning_rate=FLAGS.inversion_lr,
                                  tv_weight=FLAGS.tv_weight)
    except ConfigError as e:
      raise
    synthetic = np.asarray(gefl_f_synthetic_images(cfg.method_config, fed.spec.num_classes, fed.spec.groups[0],
                                                 state.server, key, FLAGS.per_class, inversion))
  else:
    synthetic = np.asarray(fed.algorithm.samples(state.server, fed.spec, key, FLAGS.per_class))
    synthetic = synthetic.reshape((-1,) + synthetic.shape[2:])
  rng = np.random.default_rng(FLAGS.seed)
  train_x = np.concatenate([np.asarray(g.train.x[i, :g.train_sizes[i]]) for g in fed.groups for i in range(g.size)])
  dataset = fed.data.dataset
  test_x = dataset.x_test if dataset.x_test is not None else dataset.x
  points = train_x[rng.choice(len(train_x), min(FLAGS.points, len(train_x)), replace=False)]
  validation = test_x[rng.choice(len(test_x), min(len(synthetic), len(test_x)), replace=False)]
  out = {'round': int(state.round), 'points': len(points), 'synthetic': len(synthetic),
         'validation': len(validation)}
  for distance in FLAGS.distances:
    try:
      embed = embedding(distance, points.shape[1:])
    except ConfigError as e:
      raise
    out[f'mnd_{distance}'], _ = mnd_ratio(points, validation, synthetic, embed)
    print(f'MND ratio ({distance} L2) of {cfg.algorithm} at round {out["round"]}: {out[f"mnd_{distance}"]:.4f}')
  with open(os.path.join(FLAGS.workdir, 'mnd.json'), 'w') as f:
    json.dump(out, f, indent=2)


if __name__ == '__main__':
  cli.app_run(main)
