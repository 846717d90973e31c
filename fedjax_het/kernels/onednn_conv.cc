// oneDNN's 2-D convolution (forward, input gradient, kernel gradient) as XLA FFI handlers for the CPU backend.
//
// Layouts are JAX's channels-last ones: input [N, H, W, C], kernel [KH, KW, C / G, O] (HWIO), output [N, OH, OW, O].
// Attributes: strides [2], padding [4] (low/high of H, then of W), dilation [2] (the kernel's, 1 = none), groups
// G (lax's feature_group_count: output channel o sees the input channels of group o / (O / G); depthwise when
// G = C).
// Activations stay channels-last (oneDNN's nhwc kernels); the kernel is reordered to oneDNN's preferred blocked
// layout and back, which for these sizes costs a small fraction of a convolution. Primitives are built once per
// geometry, thread count and pass, and shared by all calling threads (oneDNN primitives are safe to execute
// concurrently when each execution has its own scratchpad). fedjax_het compiles this file on first use
// (fedjax_het/kernels/onednn.py).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

// The OpenMP runtime oneDNN was built with (GNU's, for the `onednn` extra's wheels); resolved through libdnnl's
// own dependency when this library is loaded, so that the setting reaches the runtime oneDNN uses.
extern "C" {
int omp_get_max_threads(void);
void omp_set_num_threads(int);
}

namespace ffi = xla::ffi;
using dims = dnnl::memory::dims;
using tag = dnnl::memory::format_tag;
using f32 = dnnl::memory::data_type;

namespace {

std::atomic<int> threads_per_call{0};  // 0: OpenMP's default (OMP_NUM_THREADS, else all cores)

enum Pass { kForward = 0, kInputGradient = 1, kKernelGradient = 2 };

struct Geometry {
  dims x, w, y, strides, dilation, pad_low, pad_high;  // w: {O, I, KH, KW}, or {G, O / G, I, KH, KW} grouped
  auto key() const { return std::tie(x, w, y, strides, dilation, pad_low, pad_high); }
  bool operator<(const Geometry& o) const { return key() < o.key(); }
};

// One pass of one geometry: its primitive and the reorder of the kernel between HWIO and the primitive's blocked
// layout (absent when they agree). Every primitive takes its scratchpad from the caller: oneDNN's own scratchpad
// belongs to the thread that created the primitive (unless oneDNN was built for concurrent execution), and these
// primitives, created once, run on every client thread at once.
struct Plan {
  dnnl::primitive primitive;
  dnnl::memory::desc kernel;  // the primitive's kernel (or kernel gradient) layout
  bool reorder = false;
  dnnl::primitive reorder_kernel;  // HWIO -> kernel (forward, input gradient) or kernel -> HWIO (kernel gradient)
  size_t scratch = 0, reorder_scratch = 0;
};

dnnl::engine& Engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// The kernel as JAX lays it out: HWIO, the output channels group-major when grouped (hwigo).
dnnl::memory::desc Hwio(const Geometry& g) {
  return dnnl::memory::desc(g.w, f32::f32, g.w.size() == 5 ? tag::hwigo : tag::hwio);
}

Plan MakePlan(Pass pass, const Geometry& g) {
  auto& eng = Engine();
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  attr.set_fpmath_mode(dnnl::fpmath_mode::strict);  // float32 arithmetic whatever ONEDNN_DEFAULT_FPMATH_MODE says
  auto x = dnnl::memory::desc(g.x, f32::f32, tag::nhwc);
  auto y = dnnl::memory::desc(g.y, f32::f32, tag::nhwc);
  auto any = dnnl::memory::desc(g.w, f32::f32, tag::any);
  auto hwio = Hwio(g);
  auto forward = dnnl::convolution_forward::primitive_desc(
      eng, dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, x, any, y, g.strides,
      g.dilation, g.pad_low, g.pad_high, attr);
  Plan plan;
  if (pass == kForward) {
    plan.primitive = dnnl::convolution_forward(forward);
    plan.kernel = forward.weights_desc();
    plan.scratch = forward.scratchpad_desc().get_size();
  } else if (pass == kInputGradient) {
    auto pd = dnnl::convolution_backward_data::primitive_desc(eng, dnnl::algorithm::convolution_direct, x, any, y,
                                                              g.strides, g.dilation, g.pad_low, g.pad_high, forward,
                                                              attr);
    plan.primitive = dnnl::convolution_backward_data(pd);
    plan.kernel = pd.weights_desc();
    plan.scratch = pd.scratchpad_desc().get_size();
  } else {
    auto pd = dnnl::convolution_backward_weights::primitive_desc(
        eng, dnnl::algorithm::convolution_direct, x, any, y, g.strides, g.dilation, g.pad_low, g.pad_high, forward,
        attr);
    plan.primitive = dnnl::convolution_backward_weights(pd);
    plan.kernel = pd.diff_weights_desc();
    plan.scratch = pd.scratchpad_desc().get_size();
  }
  plan.reorder = plan.kernel != hwio;
  if (plan.reorder) {
    auto pd = pass == kKernelGradient ? dnnl::reorder::primitive_desc(eng, plan.kernel, eng, hwio, attr)
                                      : dnnl::reorder::primitive_desc(eng, hwio, eng, plan.kernel, attr);
    plan.reorder_kernel = dnnl::reorder(pd);
    plan.reorder_scratch = pd.scratchpad_desc().get_size();
  }
  return plan;
}

const Plan& GetPlan(Pass pass, const Geometry& g, int threads) {
  static std::mutex mutex;
  static std::map<std::tuple<int, int, Geometry>, std::unique_ptr<Plan>> plans;
  std::lock_guard<std::mutex> lock(mutex);
  auto& plan = plans[{pass, threads, g}];
  if (!plan) plan = std::make_unique<Plan>(MakePlan(pass, g));
  return *plan;
}

int64_t Elements(const dims& d) {
  int64_t n = 1;
  for (auto v : d) n *= v;
  return n;
}

// This thread's scratch memory of at least `bytes` (grown, never shrunk).
dnnl::memory Scratch(size_t bytes) {
  thread_local std::vector<uint8_t> buffer;
  if (buffer.size() < bytes) buffer.resize(bytes);
  auto desc = dnnl::memory::desc({static_cast<int64_t>(bytes)}, dnnl::memory::data_type::u8, tag::a);
  return dnnl::memory(desc, Engine(), buffer.data());
}

// a: input (forward, kernel gradient) or output gradient (input gradient); b: kernel (forward, input gradient) or
// output gradient (kernel gradient); out: output, input gradient or kernel gradient.
ffi::Error Run(Pass pass, const Geometry& g, float* a, float* b, float* out) {
  const dims& out_dims = pass == kForward ? g.y : pass == kInputGradient ? g.x : g.w;
  if (Elements(g.x) == 0 || Elements(g.y) == 0 || Elements(g.w) == 0) {  // nothing to sum: zeros
    std::memset(out, 0, sizeof(float) * Elements(out_dims));
    return ffi::Error::Success();
  }
  // This calling thread's OpenMP teams, for this call only: the thread's setting is shared with every other
  // library on the same OpenMP runtime (PyTorch's CPU build among them), so it is put back on return.
  const int before = omp_get_max_threads();
  const int requested = threads_per_call.load();
  const int threads = requested > 0 ? requested : before;
  omp_set_num_threads(threads);
  ffi::Error status = ffi::Error::Success();
  try {
    const Plan& plan = GetPlan(pass, g, threads);
    auto& eng = Engine();
    dnnl::stream stream(eng);
    auto x = dnnl::memory::desc(g.x, f32::f32, tag::nhwc);
    auto y = dnnl::memory::desc(g.y, f32::f32, tag::nhwc);
    auto hwio = Hwio(g);
    dnnl::memory scratch = Scratch(std::max(plan.scratch, plan.reorder_scratch));
    dnnl::memory w(hwio, eng, pass == kKernelGradient ? out : b);
    dnnl::memory kernel = plan.reorder ? dnnl::memory(plan.kernel, eng) : w;
    if (pass == kKernelGradient) {
      dnnl::memory src(x, eng, a), diff_dst(y, eng, b);
      plan.primitive.execute(stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_DIFF_DST, diff_dst},
                                      {DNNL_ARG_DIFF_WEIGHTS, kernel}, {DNNL_ARG_SCRATCHPAD, scratch}});
      if (plan.reorder) {
        plan.reorder_kernel.execute(stream, {{DNNL_ARG_FROM, kernel}, {DNNL_ARG_TO, w},
                                             {DNNL_ARG_SCRATCHPAD, scratch}});
      }
    } else {
      if (plan.reorder) {
        plan.reorder_kernel.execute(stream, {{DNNL_ARG_FROM, w}, {DNNL_ARG_TO, kernel},
                                             {DNNL_ARG_SCRATCHPAD, scratch}});
      }
      if (pass == kForward) {
        dnnl::memory src(x, eng, a), dst(y, eng, out);
        plan.primitive.execute(stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, kernel}, {DNNL_ARG_DST, dst},
                                        {DNNL_ARG_SCRATCHPAD, scratch}});
      } else {
        dnnl::memory diff_dst(y, eng, a), diff_src(x, eng, out);
        plan.primitive.execute(stream, {{DNNL_ARG_DIFF_DST, diff_dst}, {DNNL_ARG_WEIGHTS, kernel},
                                        {DNNL_ARG_DIFF_SRC, diff_src}, {DNNL_ARG_SCRATCHPAD, scratch}});
      }
    }
    stream.wait();
  } catch (const dnnl::error& e) {
    status = ffi::Error(ffi::ErrorCode::kInternal, std::string("oneDNN convolution failed: ") + e.what());
  } catch (const std::exception& e) {  // e.g. std::bad_alloc of a scratchpad: an error, not a terminated process
    status = ffi::Error(ffi::ErrorCode::kInternal, std::string("oneDNN convolution failed: ") + e.what());
  } catch (...) {
    status = ffi::Error(ffi::ErrorCode::kInternal, "oneDNN convolution failed");
  }
  omp_set_num_threads(before);
  return status;
}

// x: [N, H, W, C], w: [KH, KW, C / G, O], y: [N, OH, OW, O] as oneDNN's logical dims (NCHW order, OIHW order,
// GOIHW when grouped).
ffi::Error Convolve(Pass pass, ffi::Span<const int64_t> x, ffi::Span<const int64_t> w, ffi::Span<const int64_t> y,
                    ffi::Span<const int64_t> strides, ffi::Span<const int64_t> padding,
                    ffi::Span<const int64_t> dilation, int64_t groups, float* a, float* b, float* out) {
  if (x.size() != 4 || w.size() != 4 || y.size() != 4 || strides.size() != 2 || padding.size() != 4 ||
      dilation.size() != 2) {
    return ffi::Error::InvalidArgument("oneDNN convolution: 2-D NHWC/HWIO operands and 2 strides, 4 pads, 2 "
                                       "dilations expected");
  }
  if (groups < 1 || x[3] != w[2] * groups || w[3] % groups != 0) {
    return ffi::Error::InvalidArgument("oneDNN convolution: the input channels must be the kernel's times the "
                                       "groups, and the output channels a multiple of the groups");
  }
  Geometry g;
  g.x = {x[0], x[3], x[1], x[2]};
  if (groups == 1) {
    g.w = {w[3], w[2], w[0], w[1]};
  } else {
    g.w = {groups, w[3] / groups, w[2], w[0], w[1]};
  }
  g.y = {y[0], y[3], y[1], y[2]};
  g.strides = {strides[0], strides[1]};
  g.dilation = {dilation[0] - 1, dilation[1] - 1};  // oneDNN counts the zeros between taps
  g.pad_low = {padding[0], padding[2]};
  g.pad_high = {padding[1], padding[3]};
  return Run(pass, g, a, b, out);
}

using Array = ffi::Buffer<ffi::F32>;
using Result = ffi::ResultBuffer<ffi::F32>;
using Ints = ffi::Span<const int64_t>;

ffi::Error Forward(Array x, Array w, Result y, Ints strides, Ints padding, Ints dilation, int64_t groups) {
  return Convolve(kForward, x.dimensions(), w.dimensions(), y->dimensions(), strides, padding, dilation, groups,
                  x.typed_data(), w.typed_data(), y->typed_data());
}

ffi::Error InputGradient(Array dy, Array w, Result dx, Ints strides, Ints padding, Ints dilation, int64_t groups) {
  return Convolve(kInputGradient, dx->dimensions(), w.dimensions(), dy.dimensions(), strides, padding, dilation,
                  groups, dy.typed_data(), w.typed_data(), dx->typed_data());
}

ffi::Error KernelGradient(Array x, Array dy, Result dw, Ints strides, Ints padding, Ints dilation, int64_t groups) {
  return Convolve(kKernelGradient, x.dimensions(), dw->dimensions(), dy.dimensions(), strides, padding, dilation,
                  groups, x.typed_data(), dy.typed_data(), dw->typed_data());
}

}  // namespace

#define FEDJAX_HET_CONV_HANDLER(name, fn)                                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, fn,                                                          \
                                ffi::Ffi::Bind()                                                   \
                                    .Arg<Array>()                                                  \
                                    .Arg<Array>()                                                  \
                                    .Ret<Array>()                                                  \
                                    .Attr<Ints>("strides")                                         \
                                    .Attr<Ints>("padding")                                         \
                                    .Attr<Ints>("dilation")                                        \
                                    .Attr<int64_t>("groups"))

FEDJAX_HET_CONV_HANDLER(fedjax_het_onednn_conv_forward, Forward);
FEDJAX_HET_CONV_HANDLER(fedjax_het_onednn_conv_input_gradient, InputGradient);
FEDJAX_HET_CONV_HANDLER(fedjax_het_onednn_conv_kernel_gradient, KernelGradient);

extern "C" {

// OpenMP threads of each oneDNN call (0: all cores); set once per run from the executor's client threads.
void fedjax_het_onednn_set_threads(int threads) { threads_per_call.store(threads < 0 ? 0 : threads); }

// "major.minor.patch" of the oneDNN library loaded.
const char* fedjax_het_onednn_version() {
  static std::string version = [] {
    const dnnl_version_t* v = dnnl_version();
    return std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
  }();
  return version.c_str();
}

}  // extern "C"
