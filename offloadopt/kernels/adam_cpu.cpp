// offloadopt: one fused CPU Adam/AdamW step over lists of 1-D tensors (adam_step below).
//
//   mode (master/moments)  grad  weights out  bytes/elem  passes  SR draws  GB/s (x triad)
//   fp32/fp32 (torch's)    fp32  -            28          1       0         163 (0.57x)
//   fp32/bf16              bf16  bf16 (RNE)   20          2       1         154 (0.61x)
//   fp32/int8              bf16  bf16 (RNE)   16.06       3       0         135 (0.69x)
//   bf16-sr/fp32           bf16  -            22          2       1         -
//   bf16-sr/bf16           bf16  -            14          2       2         119 (0.78x)
//   bf16-sr/int8           bf16  -            10.06       3       1         100 (0.94x)
// Bytes read + written per element, bf16 grads (an fp32 grad adds 2), int8 block scales
// included. GB/s: 1.558e9 params, 16 threads of the GPU host's Xeon (AVX-512), beside a STREAM
// triad of 93.4 GB/s in the same run (x triad: time over bytes / triad; below 1 where no line
// is read for ownership): benchmarks/RESULTS.md, "The CPU kernel at the memory bus" (d6bc17d,
// 2026-12-07; on that machine torch's fp32 kernel ran above the triad; before the compressed
// modes took two passes). Passes a 256-element block: the compressed modes update the moments,
// then the masters from the moments kept in L1, and int8 writes its codes last (L1 too); each
// operand is read from memory once. The body (cpu/adam_body.h) is written
// once over cpu/simd.h and compiled here for AVX-512, AVX2 and plain C++ (generic);
// `current_isa` takes the best the CPU has, and every ISA gives the same bits (IEEE operations
// only). The math and the stochastic rounding are specified in reference.py, the formats in
// formats.py.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define OFFLOADOPT_X86 1
#endif

namespace {

constexpr int64_t BLOCK = 256;
constexpr int64_t RUN = 4096;  // blocks in one span at most (1 Mi elements)
// With backups, blocks in one span at most: the span's operands (copied out first, then
// updated) stay in the core's L2 between the two (16 blocks: 4096 elements, <= 48 KiB).
constexpr int64_t BACKUP_RUN = 16;

enum class Master : int { Fp32, Bf16Sr };
enum class Moments : int { Fp32 = 0, Bf16Sr = 1, Int8Block = 2 };

// Whether backups are written with non-temporal (streaming) stores (set_backup_stream).
std::atomic<bool> g_backup_stream{true};
// wall ns spent in the update's parallel regions, summed over calls (kernel_ns()): the
// kernel's own time, without the GIL, the argument checks or the Python around the call
std::atomic<int64_t> g_kernel_ns{0};

// Copy n bytes; with streaming stores the destination's lines are neither read first nor kept
// in cache: the copy moves n bytes in and n out, not 3n.
inline void backup_copy(void* dst, const void* src, size_t n) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
#ifdef OFFLOADOPT_X86
  constexpr size_t W = 16;
  if (g_backup_stream.load(std::memory_order_relaxed) && n >= 2 * W) {
    const size_t head = (W - (reinterpret_cast<uintptr_t>(d) & (W - 1))) & (W - 1);
    std::memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    for (; n >= W; n -= W, d += W, s += W)
      _mm_stream_si128(reinterpret_cast<__m128i*>(d), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  }
#endif
  std::memcpy(d, s, n);
}

inline void backup_fence() {
#ifdef OFFLOADOPT_X86
  _mm_sfence();  // streaming stores are weakly ordered: visible before the region ends
#endif
}

#include "cpu/sr_keys.h"

// Per-tensor scalars (torch computes them in double, then casts to float).
struct Coefs {
  float gscale;        // grad divisor (grad_scale)
  float wd;            // Adam: g = fma(p, wd, g)
  float decay;         // AdamW: p *= 1 - lr*wd
  float lerp;          // exp_avg's lerp weight: 1 - beta1, or (1 - beta1) - 1 when lerp_small is false
  bool lerp_small;     // |1 - beta1| < 0.5
  float b2, c2;        // beta2, 1 - beta2
  float bc2s;          // sqrt(1 - beta2^step)
  float eps, neg_step;     // all-fp32 mode: eps, -lr / (1 - beta1^step)
  float eps_c, neg_step_c;  // compressed modes: the same times sqrt(bc2) (one division)
  uint64_t key[2];     // stochastic rounding draws: 0 master, 1 moments
};

struct Job {
  bool has_gs, maximize, adamw, has_wd;
  std::vector<void*> master, grad, m, v, wo;
  std::vector<float*> ms, vs;
  std::vector<int64_t> numel, tail_start, offsets, first_block;
  std::vector<Coefs> coefs;
};

using SpanFn = void (*)(const Job&, size_t, int64_t, int64_t);

}  // namespace

// One copy of the body per ISA. GCC and Clang compile intrinsics for a target inside a region
// that enables it, whatever the command line's -m flags: one build serves every x86 CPU.
#if defined(OFFLOADOPT_X86) && defined(__GNUC__)
#ifdef __clang__
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#endif
namespace isa_avx512 {
namespace {
#define OO_SIMD_AVX512
#include "cpu/simd.h"
#include "cpu/int8_codes.h"
#include "cpu/bf16_bits.h"
#include "cpu/adam_body.h"
#undef OO_SIMD_AVX512
}  // namespace
}  // namespace isa_avx512
#ifdef __clang__
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
namespace isa_avx2 {
namespace {
#define OO_SIMD_AVX2
#include "cpu/simd.h"
#include "cpu/int8_codes.h"
#include "cpu/bf16_bits.h"
#include "cpu/adam_body.h"
#undef OO_SIMD_AVX2
}  // namespace
}  // namespace isa_avx2
#ifdef __clang__
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#define OFFLOADOPT_HAVE_AVX 1
#endif

namespace isa_generic {
namespace {
#define OO_SIMD_GENERIC
#include "cpu/simd.h"
#include "cpu/int8_codes.h"
#include "cpu/bf16_bits.h"
#include "cpu/adam_body.h"
#undef OO_SIMD_GENERIC
}  // namespace
}  // namespace isa_generic

namespace {

struct Isa {
  const char* name;
  int lanes;
  SpanFn (*pick)(Master, bool, Moments, bool);
};

const Isa kGeneric{"generic", 8, isa_generic::pick};
#ifdef OFFLOADOPT_HAVE_AVX
const Isa kAvx2{"avx2", 8, isa_avx2::pick};
const Isa kAvx512{"avx512", 16, isa_avx512::pick};
#endif

// The ISAs this CPU runs, best first.
std::vector<const Isa*> supported_isas() {
  std::vector<const Isa*> out;
#ifdef OFFLOADOPT_HAVE_AVX
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    out.push_back(&kAvx512);
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) out.push_back(&kAvx2);
#endif
  out.push_back(&kGeneric);
  return out;
}

std::atomic<const Isa*> g_isa{nullptr};

const Isa* current_isa() {
  const Isa* isa = g_isa.load();
  if (!isa) {
    isa = supported_isas().front();
    g_isa.store(isa);
  }
  return isa;
}

#include "cpu/arg_checks.h"

}  // namespace

void adam_step(std::vector<at::Tensor> masters, std::vector<at::Tensor> grads, std::vector<at::Tensor> exp_avgs,
               std::vector<at::Tensor> exp_avg_sqs, std::vector<at::Tensor> exp_avg_scales,
               std::vector<at::Tensor> exp_avg_sq_scales, std::vector<at::Tensor> weights_out,
               std::vector<double> steps, std::vector<int64_t> salts, std::vector<int64_t> offsets, double lr,
               double beta1, double beta2, double weight_decay, double eps, bool maximize, bool decoupled,
               std::optional<double> grad_scale, int64_t moments, bool master_sr, int64_t vec_size,
               bool flush_denormal, std::vector<at::Tensor> backups) {
  const size_t T = masters.size();
  auto same_len = [&](size_t k, const char* name) {
    TORCH_CHECK_VALUE(k == T, "adam_step: ", name, " has ", N(k), " entries; masters has ", N(T));
  };
  same_len(grads.size(), "grads");
  same_len(exp_avgs.size(), "exp_avgs");
  same_len(exp_avg_sqs.size(), "exp_avg_sqs");
  same_len(steps.size(), "steps");
  same_len(salts.size(), "salts");
  same_len(offsets.size(), "offsets");
  TORCH_CHECK_VALUE(moments >= 0 && moments <= 2, "adam_step: moments=", N(moments),
                    "; expected 0 (fp32), 1 (bf16) or 2 (int8 codes)");
  if (moments == 2) {
    same_len(exp_avg_scales.size(), "exp_avg_scales");
    same_len(exp_avg_sq_scales.size(), "exp_avg_sq_scales");
  } else {
    TORCH_CHECK_VALUE(exp_avg_scales.empty() && exp_avg_sq_scales.empty(), "adam_step: exp_avg_scales/",
                      "exp_avg_sq_scales must be empty lists unless moments=2 (int8)");
  }
  TORCH_CHECK_VALUE(weights_out.empty() || weights_out.size() == T, "adam_step: weights_out has ",
                    N(weights_out.size()), " entries; expected 0 or ", N(T));
  const size_t per = moments == 2 ? 5 : 3;  // backups per tensor
  TORCH_CHECK_VALUE(backups.empty() || backups.size() == per * T, "adam_step: backups has ", N(backups.size()),
                    " entries; expected 0 or ", N(per * T), " (", N(per), " per tensor: master, exp_avg, exp_avg_sq",
                    moments == 2 ? ", exp_avg_scale, exp_avg_sq_scale)" : ")");
  TORCH_CHECK_VALUE(vec_size == 4 || vec_size == 8 || vec_size == 16, "adam_step: vec_size=", N(vec_size),
                    "; expected 4, 8 or 16 (torch_vec_size())");
  if (T == 0) return;
  const bool mbf16 = masters[0].scalar_type() == at::kBFloat16;
  const bool gbf16 = grads[0].scalar_type() == at::kBFloat16;
  TORCH_CHECK_VALUE(!mbf16 || master_sr, "adam_step: bf16 masters need master_sr=True (stochastic rounding)");
  TORCH_CHECK_VALUE(mbf16 || !master_sr, "adam_step: master_sr=True needs bf16 masters; masters[0] is ",
                    masters[0].scalar_type());
  TORCH_CHECK_VALUE(!mbf16 || weights_out.empty(),
                    "adam_step: weights_out is only for fp32 masters (bf16 masters are the weights)");
  for (size_t i = 0; i < T; ++i) {
    const int64_t n = masters[i].numel();
    check_1d(masters[i], "masters", i, n, {mbf16 ? at::kBFloat16 : at::kFloat},
             mbf16 ? "bfloat16 (as masters[0])" : "float32 (as masters[0])");
    check_1d(grads[i], "grads", i, n, {gbf16 ? at::kBFloat16 : at::kFloat},
             gbf16 ? "bfloat16 (as grads[0])" : "float32 (as grads[0])");
    auto st = moments == 0 ? at::kFloat : moments == 1 ? at::kBFloat16 : at::kByte;
    const char* sn = moments == 0 ? "float32 (moments=0)" : moments == 1 ? "bfloat16 (moments=1)" : "uint8 (moments=2)";
    check_1d(exp_avgs[i], "exp_avgs", i, n, {st}, sn);
    check_1d(exp_avg_sqs[i], "exp_avg_sqs", i, n, {st}, sn);
    if (moments == 2) {
      const int64_t nb = (n + BLOCK - 1) / BLOCK;
      check_1d(exp_avg_scales[i], "exp_avg_scales", i, nb, {at::kFloat}, "float32");
      check_1d(exp_avg_sq_scales[i], "exp_avg_sq_scales", i, nb, {at::kFloat}, "float32");
    }
    if (!weights_out.empty()) check_1d(weights_out[i], "weights_out", i, n, {at::kBFloat16}, "bfloat16");
    if (!backups.empty()) {
      const at::Tensor* src[5] = {&masters[i], &exp_avgs[i], &exp_avg_sqs[i], nullptr, nullptr};
      if (moments == 2) {
        src[3] = &exp_avg_scales[i];
        src[4] = &exp_avg_sq_scales[i];
      }
      for (size_t k = 0; k < per; ++k) {
        const at::Tensor& b = backups[per * i + k];
        check_1d(b, "backups", per * i + k, src[k]->numel(), {src[k]->scalar_type()},
                 "the dtype of the tensor it backs up");
        TORCH_CHECK_VALUE(b.data_ptr() != src[k]->data_ptr(), "adam_step: backups[", N(per * i + k),
                          "] is the tensor it backs up");
      }
    }
    TORCH_CHECK_VALUE(steps[i] >= 1, "adam_step: steps[", N(i), "]=", D(steps[i]), "; expected >= 1 (already advanced)");
    TORCH_CHECK_VALUE(offsets[i] >= 0, "adam_step: offsets[", N(i), "]=", N(offsets[i]), "; expected >= 0");
  }
  TORCH_CHECK_VALUE(!grad_scale.has_value() || *grad_scale != 0.0, "adam_step: grad_scale=0");

  Job J;
  J.has_gs = grad_scale.has_value();
  J.maximize = maximize;
  J.adamw = decoupled;
  J.has_wd = weight_decay != 0.0;
  const bool wout = !weights_out.empty();
  const bool bk = !backups.empty();
  const size_t master_es = mbf16 ? 2 : 4, state_es = moments == 0 ? 4 : moments == 1 ? 2 : 1;
  std::vector<void*> bmaster(bk ? T : 0), bm(bk ? T : 0), bv(bk ? T : 0);
  std::vector<float*> bms(bk ? T : 0, nullptr), bvs(bk ? T : 0, nullptr);
  J.master.resize(T);
  J.grad.resize(T);
  J.m.resize(T);
  J.v.resize(T);
  J.wo.resize(T, nullptr);
  J.ms.resize(T, nullptr);
  J.vs.resize(T, nullptr);
  J.numel.resize(T);
  J.tail_start.resize(T);
  J.offsets = offsets;
  J.first_block.resize(T + 1);
  J.coefs.resize(T);
  // torch's scalar tail (Note [torch parity] in cpu/adam_body.h): all-fp32 mode only
  const bool parity_tail = !mbf16 && moments == 0 && vec_size >= 8;
  int64_t nblocks = 0;
  for (size_t i = 0; i < T; ++i) {
    const int64_t n = masters[i].numel();
    J.master[i] = masters[i].data_ptr();
    J.grad[i] = grads[i].data_ptr();
    J.m[i] = exp_avgs[i].data_ptr();
    J.v[i] = exp_avg_sqs[i].data_ptr();
    if (wout) J.wo[i] = weights_out[i].data_ptr();
    if (bk) {
      bmaster[i] = backups[per * i].data_ptr();
      bm[i] = backups[per * i + 1].data_ptr();
      bv[i] = backups[per * i + 2].data_ptr();
      if (moments == 2) {
        bms[i] = backups[per * i + 3].data_ptr<float>();
        bvs[i] = backups[per * i + 4].data_ptr<float>();
      }
    }
    if (moments == 2) {
      J.ms[i] = exp_avg_scales[i].data_ptr<float>();
      J.vs[i] = exp_avg_sq_scales[i].data_ptr<float>();
    }
    J.numel[i] = n;
    J.tail_start[i] = parity_tail ? n - n % 8 : n;
    J.first_block[i] = nblocks;
    nblocks += (n + BLOCK - 1) / BLOCK;
    // the scalars, as torch computes them (double, then cast to float)
    const double step = steps[i];
    const double bc1 = 1 - std::pow(beta1, step);
    const double bc2 = 1 - std::pow(beta2, step);
    const double step_size = lr / bc1;
    Coefs& c = J.coefs[i];
    c.gscale = grad_scale.has_value() ? (float)*grad_scale : 1.f;
    c.wd = (float)weight_decay;
    c.decay = (float)(1 - lr * weight_decay);
    const float w = (float)(1 - beta1);
    c.lerp_small = std::fabs(w) < 0.5f;
    c.lerp = c.lerp_small ? w : w - 1.f;
    c.b2 = (float)beta2;
    c.c2 = (float)(1 - beta2);
    c.bc2s = (float)std::sqrt(bc2);
    c.eps = (float)eps;
    c.neg_step = (float)(-step_size);
    c.eps_c = (float)(eps * std::sqrt(bc2));
    c.neg_step_c = (float)(-step_size * std::sqrt(bc2));
    for (int d = 0; d < 2; ++d) c.key[d] = sr_key(salts[i], step, d);
  }
  J.first_block[T] = nblocks;
  if (nblocks == 0) return;
  const SpanFn fn = current_isa()->pick(mbf16 ? Master::Bf16Sr : Master::Fp32, gbf16, (Moments)moments, wout);
  const int64_t max_run = bk ? BACKUP_RUN : RUN;

  // Threads claim chunks of blocks from a shared counter, not one fixed share each: a thread
  // slowed by a shared core or the link's copies leaves its rest to the others, so a call
  // ends near the threads' mean time, not the slowest one's. About 16 chunks a thread; the
  // bits do not depend on the cuts (every element's result is a function of its position).
  const int64_t slots = std::min<int64_t>(at::get_num_threads(), nblocks);
  const int64_t chunk = std::clamp<int64_t>(nblocks / (16 * slots), 16, RUN);
  // blocks [begin, end), span by span (a span: a run of one tensor's blocks, at most max_run)
  const auto run_blocks = [&](int64_t begin, int64_t end) {
    size_t i = std::upper_bound(J.first_block.begin(), J.first_block.end(), begin) - J.first_block.begin() - 1;
    for (int64_t b = begin; b < end;) {
      while (b >= J.first_block[i + 1]) ++i;
      const int64_t run = std::min({end, J.first_block[i + 1], b + max_run}) - b;
      const int64_t j0 = (b - J.first_block[i]) * BLOCK;
      const int64_t len = std::min(j0 + run * BLOCK, J.numel[i]) - j0;
      if (bk) {  // the span's pre-step values, copied out just before the update reads them
        backup_copy(static_cast<char*>(bmaster[i]) + j0 * master_es,
                    static_cast<const char*>(J.master[i]) + j0 * master_es, len * master_es);
        backup_copy(static_cast<char*>(bm[i]) + j0 * state_es, static_cast<const char*>(J.m[i]) + j0 * state_es,
                    len * state_es);
        backup_copy(static_cast<char*>(bv[i]) + j0 * state_es, static_cast<const char*>(J.v[i]) + j0 * state_es,
                    len * state_es);
        if (moments == 2)
          for (int64_t k = j0 / BLOCK; k < j0 / BLOCK + run; ++k) {
            bms[i][k] = J.ms[i][k];
            bvs[i][k] = J.vs[i][k];
          }
      }
      fn(J, i, j0, len);
      b += run;
    }
  };
  std::atomic<int64_t> next{0};
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, slots, 1, [&](int64_t, int64_t) {
#ifdef OFFLOADOPT_X86
    const unsigned int csr = _mm_getcsr();
    if (flush_denormal) _mm_setcsr(csr | 0x8040U);  // FTZ | DAZ
#endif
    for (int64_t begin; (begin = next.fetch_add(chunk, std::memory_order_relaxed)) < nblocks;)
      run_blocks(begin, std::min(begin + chunk, nblocks));
    backup_fence();  // the backups' and weights_out's streaming stores, visible when the region ends
#ifdef OFFLOADOPT_X86
    _mm_setcsr(csr);
#endif
  });
  g_kernel_ns.fetch_add(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
}

int64_t num_threads_used() {
  // how many threads one parallel region over many blocks runs on (a check that the build
  // has OpenMP: without it at::parallel_for runs on one thread)
  std::atomic<int64_t> seen{0};
  at::parallel_for(0, 1 << 16, 1, [&](int64_t, int64_t) { seen.fetch_add(1); });
  return seen.load();
}

std::vector<std::string> isas() {
  std::vector<std::string> out;
  for (const Isa* isa : supported_isas()) out.push_back(isa->name);
  return out;
}

// Run every later call on the named ISA ("avx512", "avx2" or "generic"); raises ValueError for
// one this CPU (or this build) does not run.
void set_isa(const std::string& name) {
  for (const Isa* isa : supported_isas())
    if (name == isa->name) {
      g_isa.store(isa);
      return;
    }
  std::string ok;
  for (const std::string& s : isas()) ok += (ok.empty() ? "" : ", ") + s;
  TORCH_CHECK_VALUE(false, "set_isa: '", name, "' is not run by this CPU; it runs: ", ok);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("adam_step", &adam_step, "Fused Adam/AdamW step over lists of 1-D CPU tensors (see offloadopt.kernels)",
          py::arg("masters"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
          py::arg("exp_avg_scales"), py::arg("exp_avg_sq_scales"), py::arg("weights_out"), py::arg("steps"),
          py::arg("salts"), py::arg("offsets"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
          py::arg("weight_decay"), py::arg("eps"), py::arg("maximize"), py::arg("decoupled"),
          py::arg("grad_scale"), py::arg("moments"), py::arg("master_sr"), py::arg("vec_size"),
          py::arg("flush_denormal"), py::arg("backups") = std::vector<at::Tensor>(),
          // The GIL is released for the update: the worker thread runs it while the training
          // thread launches backward (held, it serialized the two: a step at fraction 1 took
          // fwd+bwd + the update on the GPU host, 2.09x torch's kernel path).
          py::call_guard<py::gil_scoped_release>());
  mod.def("num_threads_used", &num_threads_used,
          "number of threads a parallel region of the extension runs on");
  mod.def("block", []() { return BLOCK; });
  mod.def("kernel_ns", []() { return g_kernel_ns.load(); },
          "wall ns spent in the update's parallel regions since the module loaded, all calls summed");
  mod.def("isa", []() { return std::string(current_isa()->name); }, "the ISA the kernel runs on");
  mod.def("lanes", []() { return current_isa()->lanes; }, "fp32 lanes per vector of that ISA");
  mod.def("isas", &isas, "the ISAs this CPU runs, best first");
  mod.def("set_isa", &set_isa, py::arg("name"), "run later calls on this ISA (tests and benchmarks)");
  mod.def("set_backup_stream", [](bool on) { g_backup_stream.store(on); },
          "write backups with streaming (non-temporal) stores (default True; False: plain copies)");
}
