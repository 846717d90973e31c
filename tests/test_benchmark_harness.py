"""The benchmarks' shared helpers: the labels of XLA's ops in a profile, and the synthetic federation's split."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'benchmarks'))
from harness import cifar_like, cpu_vector_extension, xla_op_label  # noqa: E402

HLO = '\n'.join([
    'ENTRY %main.27 (p: f32[3]) -> f32[3] {',
    '  %ynn_fusion.8 = f32[32,10,10,64]{3,2,1,0} fusion(%a, %b), kind=kCustom, calls=%fused_computation.8, '
    'metadata={op_name="jit(<lambda>)/jvp(HeteroClassifier)/HeteroClassifier.represent/extractor/Conv_1/'
    'conv_general_dilated" stack_frame_id=57}',
    '  %ynn_fusion.1 = f32[32,5,5,64]{3,2,1,0} fusion(%c, %d), kind=kCustom, calls=%fused_computation.1, '
    'metadata={op_name="jit(<lambda>)/transpose(jvp(HeteroClassifier))/HeteroClassifier.represent/extractor/Conv_1/'
    'conv_general_dilated" stack_frame_id=57}',
    '  %multiply_add_fusion.2 = f32[1600,512]{1,0} fusion(%e, %f), kind=kLoop, calls=%fused_computation.13, '
    'metadata={op_name="jit(<lambda>)/add" stack_frame_id=67}',
    '  %transpose_copy_fusion.1 = f32[32,14,14,32]{3,2,1,0} fusion(%g), kind=kLoop, calls=%fused_computation.17',
    '  %ffi_call.7 = f32[32,14,14,32]{3,2,1,0} custom-call(%h, %i), custom_call_target="fedjax_het_onednn_conv_'
    'input_gradient", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(<lambda>)/transpose(jvp('
    'HeteroClassifier))/HeteroClassifier.represent/extractor/Conv_1/ffi_call" stack_frame_id=60}',
    '}'])


def test_xla_op_labels_name_the_layer_primitive_and_pass():
  assert xla_op_label('ynn_fusion.8', HLO) == 'Conv_1 conv_general_dilated, forward [ynn_fusion.8]'
  assert xla_op_label('ynn_fusion.1', HLO) == 'Conv_1 conv_general_dilated, backward [ynn_fusion.1]'
  assert xla_op_label('multiply_add_fusion.2', HLO) == 'add, update [multiply_add_fusion.2]'
  # A custom call: the function it calls.
  assert xla_op_label('ffi_call.7', HLO) == 'Conv_1 fedjax_het_onednn_conv_input_gradient, backward [ffi_call.7]'
  # No metadata, or not in the text: the op's own name.
  assert xla_op_label('transpose_copy_fusion.1', HLO) == 'transpose_copy_fusion.1'
  assert xla_op_label('ynn_fusion', HLO) == 'ynn_fusion'


def test_cifar_like_splits_iid_or_by_dirichlet():
  def split(**kw):
    train = cifar_like(10, 40, **kw).group_train(np.arange(10))
    n, y = np.asarray(train.n), np.asarray(train.y)
    return n, np.mean([len(set(y[i, :n[i]].tolist())) for i in range(10)])
  iid_sizes, iid_labels = split()
  dirichlet_sizes, dirichlet_labels = split(partition='dirichlet', alpha=0.1)
  assert iid_labels == 10  # every client holds every class
  assert dirichlet_labels < 5  # a few classes per client (3.5 here)
  assert abs(int(iid_sizes.sum()) - int(dirichlet_sizes.sum())) <= 10  # one pool; 75% of each client's rows train


def test_the_cpus_vector_extension_is_the_widest_of_its_flags():
  assert cpu_vector_extension('fpu sse sse2 avx avx2 fma avx512f avx512dq') == 'avx512'
  assert cpu_vector_extension('fpu sse sse2 avx avx2 fma') == 'avx2'  # an AMD EPYC without AVX-512
  assert cpu_vector_extension('fp asimd evtstrm sve') == 'sve'
  assert cpu_vector_extension('fp asimd evtstrm') == 'neon'
  assert cpu_vector_extension('') == ''
  assert cpu_vector_extension() in ('avx512', 'avx2', 'avx', 'sve', 'neon', '')
