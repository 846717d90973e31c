"""Privacy evaluations of what a method shares (the DP layer that protects it is `fedjax_het.privacy`).

`attack`: the inversion attack ("FedRE: A Representation Entanglement Framework for Model-Heterogeneous Federated
Learning", Sec. 4, Q2; deep image prior) that reconstructs images from an uploaded d-vector through the client's
white-box extractor; `metrics`: how much a reconstruction leaks (PSNR / MSE on the
0-255 scale against a reference, a best match and a null image; identification); `upload_attack`: a round's uploads of
chosen clients turned into targets, and one client's attack (`attack_client`); `report`: tables and figures;
`mnd`: GeFL's memorisation ratio of a generator ("GeFL: Model-Agnostic Federated Learning with Generative Models",
Eq. 1). `experiments/invert.py` and `experiments/mnd.py` run them on a finished run.
"""

from fedjax_het.evaluation.attack import (PRIORS, DeepImagePrior, InversionConfig, extractor_fn, image_parameterisation,
                                          inversion_loss, invert, invert_one, invert_padded, inverter, target_keys,
                                          total_variation)
from fedjax_het.evaluation.metrics import (KINDS, NULL_IMAGE, PSNR_MAX, candidate_mask, class_mean_images, identified,
                                           leakage, mse_255, psnr_255, psnr_from_mse, reference_images, ssim_255,
                                           to_255)
from fedjax_het.evaluation.mnd import DISTANCES, embedding, mnd_ratio, nearest_distances
from fedjax_het.evaluation.report import leakage_table, mean_std, plot_reconstructions
from fedjax_het.evaluation.upload_attack import ClientUpload, Targets, attack_client, round_uploads, upload_targets
