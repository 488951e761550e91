// offloadopt: one fused CPU Adam/AdamW step over lists of 1-D tensors, with the optimizer
// state in fp32, bf16 (stochastic rounding) or int8 block-wise codes (see formats.py for the
// code formats; reference.py is the same math in plain torch ops).
//
// Built by offloadopt/kernels/__init__.py with -O3 -march=native -fopenmp -ffp-contract=off
// -fno-math-errno: the compiler contracts nothing on its own, so every FMA below is written out
// (std::fma), and the loops over one 256-element block vectorize (omp simd).
//
// Parity with torch._fused_adam_/_fused_adamw_ (fp32 master, fp32 moments, no rounding), found
// empirically against torch 2.13.0+cpu (capability AVX512, GCC build) element by element:
//   * torch's AVX512 loop runs 16 elements a vector over 64-byte units; its ATen Vectorized
//     arithmetic is contracted by torch's compiler. What reproduces it bit for bit:
//       Adam weight decay   g = fma(p, wd, g)
//       AdamW decay         p = p * float(1 - lr*wd)                 (no add: nothing to fuse)
//       exp_avg (lerp)      |w| < 0.5: m = fma(w, g - m, m)  else  m = fma(w - 1, g - m, g)
//       exp_avg_sq          v = fma(c2*g, g, v*beta2)                ((c2*g) rounded first)
//       denom               sqrt(v) / float(bc2_sqrt) + float(eps)   (a division: no FMA)
//       param               p + (float(-step_size) * m) / denom      (a division: no FMA)
//   * the last (numel % 16) elements of a tensor go through torch's scalar loop, which its
//     compiler auto-vectorizes 8 wide (the same contractions as above) and leaves the last
//     (numel % 8) elements scalar. Those scalar elements contract the lerp the same way
//     (m + w*(g-m) -> fma(w, g-m, m); g - (g-m)*(1-w) -> fma(-(g-m), 1-w, g), equal to the
//     vector form since w-1 == -(1-w) exactly) but exp_avg_sq the OTHER way:
//       v = fma(v, beta2, (c2*g)*g)
//     So elements j >= numel - numel % 8 use that form (`tail_start` below). With AVX2
//     (vec_size 8) torch's vector loop leaves numel % 8 elements to the scalar loop, which
//     gives the same rule; that case is inferred, not measured (no AVX2-only host here).
//     vec_size 4 (no AVX) is not matched: that build has no FMA at all.
// The tail rule is applied only in the all-fp32 mode; the other modes use the vector forms
// everywhere (reference.py follows the vector forms).
//
// Stochastic rounding to bf16: bits = (fp32 bits + (r & 0xFFFF)) >> 16, NaN -> 0x7FC0, +-inf
// unchanged, where r = sr_hash(key(salt, step, stream), counter), counter = offsets[i] + j:
//   key = mix64(salt + 0x9E3779B97F4A7C15 * (4*step + stream + 1))   (64-bit, per call/tensor)
//   x = lo32(counter) ^ lo32(key); x = fmix32(x);
//   x ^= hi32(key) ^ (hi32(counter) * 0x9E3779B9); x = fmix32(x); r = x
// mix64 is the splitmix64 finalizer (xor-shift 30/27/31, multipliers 0xBF58476D1CE4E5B9,
// 0x94D049BB133111EB); fmix32 is a 32-bit xor-shift-multiply finalizer (shifts 16/15/16,
// multipliers 0x7FEB352D, 0x846CA68B; a bijection on 32 bits with low bias). Two keyed rounds
// decorrelate streams and steps; everything per element is 32-bit and vectorizes.
// Streams: 0 master, 1 exp_avg, 2 exp_avg_sq. A finite value above the largest bf16 may round
// up to inf (as round-to-nearest would for most of that range).
//
// Work: all tensors' 256-element blocks are one range split over torch.get_num_threads()
// threads by at::parallel_for (OpenMP; a block never splits across threads). One block is one
// pass of a vectorized loop (omp simd; loop-invariant choices are bit masks, since GCC does
// not vectorize a float select on an invariant bool) reading each operand once and writing
// each once; the int8 mode keeps the block's fresh fp32 m and sqrt(v) in two 1 KiB buffers
// for the absmax, then encodes them in a second (L1-resident) pass. Checked with objdump:
// the block loops compile to vfmadd*ps / vsqrtps / vpmulld on zmm registers.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define OFFLOADOPT_HAVE_MXCSR 1
#endif
#if defined(__AVX512F__) || defined(__AVX__) || defined(__SSE2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 256;
constexpr int64_t RUN = 4096;  // blocks in one loop at most (1 Mi elements: int indices)
// With backups, blocks in one loop at most: the run's operands (copied out first, then
// updated) stay in the core's L2 between the two (16 blocks: 4096 elements, <= 48 KiB of
// master and moments).
constexpr int64_t BACKUP_RUN = 16;

// Whether backups are written with non-temporal (streaming) stores (set_backup_stream).
std::atomic<bool> g_backup_stream{true};

// Copy n bytes; with streaming stores (where the CPU has them) the destination's lines are
// neither read first nor kept in cache: the copy moves n bytes in and n out, not 3n.
inline void backup_copy(void* dst, const void* src, size_t n) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
#if defined(__AVX512F__) || defined(__AVX__) || defined(__SSE2__)
#if defined(__AVX512F__)
  constexpr size_t W = 64;
#elif defined(__AVX__)
  constexpr size_t W = 32;
#else
  constexpr size_t W = 16;
#endif
  if (g_backup_stream.load(std::memory_order_relaxed) && n >= 2 * W) {
    const size_t head = (W - (reinterpret_cast<uintptr_t>(d) & (W - 1))) & (W - 1);
    std::memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    for (; n >= W; n -= W, d += W, s += W) {
#if defined(__AVX512F__)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(d), _mm512_loadu_si512(s));
#elif defined(__AVX__)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
#else
      _mm_stream_si128(reinterpret_cast<__m128i*>(d), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
#endif
    }
  }
#endif
  std::memcpy(d, s, n);
}

inline void backup_fence() {
#if defined(__SSE2__) || defined(__AVX__) || defined(__AVX512F__)
  _mm_sfence();  // streaming stores are weakly ordered: visible before the region ends
#endif
}

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

inline uint64_t sr_key(int64_t salt, double step, int stream) {
  uint64_t s = (uint64_t)(int64_t)step;
  return mix64((uint64_t)salt + 0x9E3779B97F4A7C15ULL * (4 * s + (uint64_t)stream + 1));
}

inline uint32_t fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352DU;
  x ^= x >> 15;
  x *= 0x846CA68BU;
  x ^= x >> 16;
  return x;
}

// counter = hi << 32 | lo, all in 32-bit lanes (the caller carries lo's wrap into hi)
inline uint32_t sr_hash(uint32_t k0, uint32_t k1, uint32_t lo, uint32_t hi) {
  uint32_t x = fmix32(lo ^ k0);
  return fmix32(x ^ k1 ^ (hi * 0x9E3779B9U));
}

inline uint32_t f2u(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float u2f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// a where mask is all ones, b where it is zero
inline float sel(uint32_t mask, float a, float b) { return u2f((f2u(a) & mask) | (f2u(b) & ~mask)); }
inline float bf2f(uint16_t b) { return u2f((uint32_t)b << 16); }

// fp32 -> bf16 with stochastic rounding (r: 32 random bits, the low 16 used).
inline uint16_t f2bf_sr(float f, uint32_t r) {
  uint32_t u = f2u(f);
  bool nonfinite = (u & 0x7F800000U) == 0x7F800000U;
  bool nan = nonfinite && (u & 0x007FFFFFU);
  uint32_t rounded = (u + (r & 0xFFFFU)) >> 16;
  uint32_t out = nonfinite ? (u >> 16) : rounded;
  return (uint16_t)(nan ? 0x7FC0U : out);
}

// fp32 -> bf16 round to nearest even (as torch's .to(torch.bfloat16)).
inline uint16_t f2bf_rne(float f) {
  uint32_t u = f2u(f);
  bool nan = (u & 0x7FFFFFFFU) > 0x7F800000U;
  uint32_t rounded = (u + 0x7FFFU + ((u >> 16) & 1U)) >> 16;
  return (uint16_t)(nan ? 0x7FC0U : rounded);
}

// exp_avg code: sign | e(4) | f(3); value(e, f) = 2^(e-15) * (1 + f/8); magnitude 0 = zero.
inline float decode_m1(uint8_t c, float scale) {
  uint32_t mag = c & 0x7FU;
  uint32_t bits = mag ? ((mag + (112U << 3)) << 20) : 0U;
  float v = scale * u2f(bits);
  return (c & 0x80U) ? -v : v;
}

// t = |m| * (1/scale) in [0, 1 + 2 ulp] -> magnitude code (RNE on the fp32 bits; below 2^-14 -> 0 or the
// smallest code, the nearer, 2^-15 itself going up).
inline uint32_t encode_m_mag(float t) {
  uint32_t u = f2u(t);
  uint32_t r = (u + 0x7FFFFU + ((u >> 20) & 1U)) >> 20;  // exp8 << 3 | f3
  int32_t e = (int32_t)(r >> 3) - 112;
  uint32_t below = (u >= 0x38000000U) ? 0x08U : 0U;  // 2^-15 = 0x38000000
  return e >= 1 ? (r - (112U << 3)) : below;
}

// exp_avg_sq code: e(4) | f(4) of y = sqrt(v) / scale; value = 2^(e-15) * (1 + f/16); code 0
// only for y == 0.
inline float decode_v1(uint8_t c, float scale) {
  uint32_t bits = c ? (((uint32_t)c + (112U << 4)) << 19) : 0U;
  float s = scale * u2f(bits);
  return s * s;
}

inline uint32_t encode_v_code(float t, bool nonzero) {
  uint32_t u = f2u(t);
  uint32_t r = (u + 0x3FFFFU + ((u >> 19) & 1U)) >> 19;  // exp8 << 4 | f4
  int32_t e = (int32_t)(r >> 4) - 112;
  uint32_t below = nonzero ? 0x10U : 0U;
  return e >= 1 ? (r - (112U << 4)) : below;
}

// Per-tensor scalars (the coefficients torch computes in double, cast to float).
struct Coefs {
  float gscale;   // grad divisor (1 when no grad_scale: x / 1 == x)
  float wd;       // Adam: g += p * wd
  float decay;    // AdamW: p *= decay
  float lerp_c;   // w or w - 1
  bool lerp_small;
  float b2, c2, bc2s, eps, nss;  // nss = float(-step_size)
  uint32_t k[3][2];              // SR keys per stream
};

struct Job {
  int mode_master_bf16, mode_grad_bf16, moments;
  bool has_gs, maximize, adamw, has_wd, wout;
  std::vector<void*> master, grad, m, v, wo;
  std::vector<float*> ms, vs;
  // backups: per tensor, where the pre-step master, exp_avg, exp_avg_sq (and with int8 moments
  // their scales) are copied before the update overwrites them; empty: none
  std::vector<void*> bmaster, bm, bv;
  std::vector<float*> bms, bvs;
  size_t master_es = 4, state_es = 4;
  std::vector<int64_t> numel, tail_start, offsets, first_block;
  std::vector<Coefs> coefs;
};

// Elements [j0, j1) of tensor i (one block with int8 moments; with fp32/bf16 moments a run of
// up to RUN blocks); the grads come from gsrc (already at j0).
template <bool MBF16, bool GBF16, int MOM, bool WOUT>
void block_core(const Job& J, size_t i, int64_t j0, int64_t j1, const void* gsrc) {
  const Coefs& c = J.coefs[i];
  const int64_t len = std::min<int64_t>(j1, J.numel[i]) - j0;
  using MT = std::conditional_t<MBF16, uint16_t, float>;
  using GT = std::conditional_t<GBF16, uint16_t, float>;
  using ST = std::conditional_t<MOM == 0, float, std::conditional_t<MOM == 1, uint16_t, uint8_t>>;
  MT* P = static_cast<MT*>(J.master[i]) + j0;
  const GT* G = static_cast<const GT*>(gsrc);
  ST* M = static_cast<ST*>(J.m[i]) + j0;
  ST* V = static_cast<ST*>(J.v[i]) + j0;
  uint16_t* W = WOUT ? static_cast<uint16_t*>(J.wo[i]) + j0 : nullptr;
  // element k of the block uses torch's scalar-tail form of exp_avg_sq from here on
  const int tail = (int)std::min<int64_t>(len, J.tail_start[i] - j0);
  const uint64_t cbase = (uint64_t)(J.offsets[i] + j0);
  const uint32_t lo0 = (uint32_t)cbase, hi0 = (uint32_t)(cbase >> 32);
  // Loop-invariant choices as bit masks (GCC does not vectorize a float select on an
  // invariant bool): all-ones picks the first operand of sel().
  const uint32_t adamw_mask = (J.has_wd && J.adamw) ? ~0U : 0U;
  const uint32_t adam_mask = (J.has_wd && !J.adamw) ? ~0U : 0U;
  const uint32_t small_mask = c.lerp_small ? ~0U : 0U;
  const uint32_t neg = J.maximize ? 0x80000000U : 0U;  // maximize: flip g's sign bit
  const float wd = c.wd, decay = c.decay, lc = c.lerp_c, b2 = c.b2,
              c2 = c.c2, bc2s = c.bc2s, eps = c.eps, nss = c.nss;
  float sm = 0.f, sv = 0.f;
  float* mscale = nullptr;
  float* vscale = nullptr;
  if constexpr (MOM == 2) {
    mscale = J.ms[i] + j0 / BLOCK;
    vscale = J.vs[i] + j0 / BLOCK;
    sm = *mscale;
    sv = *vscale;
  }
  alignas(64) float mbuf[BLOCK];
  alignas(64) float ybuf[BLOCK];
  float mabs = 0.f, yabs = 0.f;
  int bad = 0;
  const int n = (int)len;
#pragma omp simd reduction(max : mabs, yabs) reduction(| : bad)
  for (int k = 0; k < n; ++k) {
    float p, g, m0, v0;
    if constexpr (MBF16) p = bf2f(P[k]); else p = P[k];
    if constexpr (GBF16) g = bf2f(G[k]); else g = G[k];
    if constexpr (MOM == 0) {
      m0 = M[k];
      v0 = V[k];
    } else if constexpr (MOM == 1) {
      m0 = bf2f(M[k]);
      v0 = bf2f(V[k]);
    } else {
      m0 = decode_m1(M[k], sm);
      v0 = decode_v1(V[k], sv);
    }
    g = u2f(f2u(g) ^ neg);
    p = sel(adamw_mask, p * decay, p);
    g = sel(adam_mask, std::fma(p, wd, g), g);
    float m = std::fma(lc, g - m0, sel(small_mask, m0, g));
    float cg = c2 * g;
    float v = k >= tail ? std::fma(v0, b2, cg * g) : std::fma(cg, g, v0 * b2);
    float y = std::sqrt(v);
    float pn = p + (nss * m) / (y / bc2s + eps);
    const uint32_t lo = lo0 + (uint32_t)k, hi = hi0 + (lo < lo0 ? 1U : 0U);
    if constexpr (MBF16) {
      P[k] = f2bf_sr(pn, sr_hash(c.k[0][0], c.k[0][1], lo, hi));
    } else {
      P[k] = pn;
    }
    if constexpr (WOUT) W[k] = f2bf_rne(pn);
    if constexpr (MOM == 0) {
      M[k] = m;
      V[k] = v;
    } else if constexpr (MOM == 1) {
      M[k] = f2bf_sr(m, sr_hash(c.k[1][0], c.k[1][1], lo, hi));
      V[k] = f2bf_sr(v, sr_hash(c.k[2][0], c.k[2][1], lo, hi));
    } else {
      float am = std::fabs(m);
      mbuf[k] = m;
      ybuf[k] = y;
      mabs = std::max(mabs, am);
      yabs = std::max(yabs, y);
      // not finite (inf or NaN; sqrt of a negative v is NaN too)
      bad |= !(am <= 3.4028234663852886e38f) | !(y <= 3.4028234663852886e38f);
    }
  }
  if constexpr (MOM == 2) {
    if (bad) {
      *mscale = NAN;
      *vscale = NAN;
      std::memset(M, 0, len);
      std::memset(V, 0, len);
      return;
    }
    *mscale = mabs;
    *vscale = yabs;
    // a zero block: scale 0, codes 0 (the masks also keep 0/0 out of the codes)
    const uint32_t mkeep = mabs == 0.f ? 0U : 0xFFU, vkeep = yabs == 0.f ? 0U : 0xFFU;
    // t = |m| * (1/scale): one division a block, not one an element (formats.py does the same)
    const float minv = mabs == 0.f ? 1.f : 1.f / mabs, yinv = yabs == 0.f ? 1.f : 1.f / yabs;
#pragma omp simd
    for (int k = 0; k < n; ++k) {
      float m = mbuf[k];
      float y = ybuf[k];
      uint32_t mm = encode_m_mag(std::fabs(m) * minv);
      uint32_t sign = (f2u(m) >> 24) & 0x80U;
      M[k] = (uint8_t)((mm ? (mm | sign) : 0U) & mkeep);
      V[k] = (uint8_t)(encode_v_code(y * yinv, y != 0.f) & vkeep);
    }
  }
}

// With a grad_scale, the block's grads are first upcast and divided into an L1-resident fp32
// buffer (so the division is paid only then), and the core reads that buffer as fp32 grads.
template <bool MBF16, bool GBF16, int MOM, bool WOUT>
void run_block(const Job& J, size_t i, int64_t j0, int64_t j1) {
  using GT = std::conditional_t<GBF16, uint16_t, float>;
  const GT* G = static_cast<const GT*>(J.grad[i]) + j0;
  if (!J.has_gs) return block_core<MBF16, GBF16, MOM, WOUT>(J, i, j0, j1, G);
  const int n = (int)std::min<int64_t>(BLOCK, J.numel[i] - j0);
  const float gscale = J.coefs[i].gscale;
  alignas(64) float gbuf[BLOCK];
#pragma omp simd
  for (int k = 0; k < n; ++k) {
    if constexpr (GBF16) gbuf[k] = bf2f(G[k]) / gscale; else gbuf[k] = G[k] / gscale;
  }
  block_core<MBF16, false, MOM, WOUT>(J, i, j0, j0 + BLOCK, gbuf);
}

using BlockFn = void (*)(const Job&, size_t, int64_t, int64_t);

template <bool MBF16, bool GBF16>
BlockFn pick_mom(int moments, bool wout) {
  if (moments == 0) return wout ? run_block<MBF16, GBF16, 0, true> : run_block<MBF16, GBF16, 0, false>;
  if (moments == 1) return wout ? run_block<MBF16, GBF16, 1, true> : run_block<MBF16, GBF16, 1, false>;
  return wout ? run_block<MBF16, GBF16, 2, true> : run_block<MBF16, GBF16, 2, false>;
}

BlockFn pick(bool mbf16, bool gbf16, int moments, bool wout) {
  if (mbf16) return gbf16 ? pick_mom<true, true>(moments, false) : pick_mom<true, false>(moments, false);
  return gbf16 ? pick_mom<false, true>(moments, wout) : pick_mom<false, false>(moments, wout);
}

// Numbers in error messages are made strings here (std::to_string, snprintf), never streamed: on
// the GPU host (torch 2.11.0+cu130, the system g++) a message that streamed an integer into
// c10::str's ostream crashed the process (SIGSEGV) where it should have raised ValueError
// (tests/test_kernels.py::test_bad_input_is_refused_before_writing; strings and dtypes streamed fine).
std::string N(int64_t x) { return std::to_string(x); }
std::string N(size_t x) { return std::to_string(x); }
std::string D(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}
std::string dims(at::IntArrayRef a) {
  std::string s = "[";
  for (size_t k = 0; k < a.size(); ++k) s += (k ? ", " : "") + std::to_string(a[k]);
  return s + "]";
}

std::string where(const char* list, size_t i) { return std::string(list) + "[" + std::to_string(i) + "]"; }

void check_1d(const at::Tensor& t, const char* list, size_t i, int64_t n, std::vector<at::ScalarType> ok,
              const char* dtypes) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "adam_step: ", where(list, i), " is on ", t.device().str(),
                    "; every tensor must be a CPU tensor");
  TORCH_CHECK_VALUE(t.dim() == 1, "adam_step: ", where(list, i), " has shape ", dims(t.sizes()),
                    "; every tensor must be 1-D");
  TORCH_CHECK_VALUE(t.is_contiguous(), "adam_step: ", where(list, i), " is not contiguous (stride ",
                    dims(t.strides()), ")");
  TORCH_CHECK_VALUE(std::find(ok.begin(), ok.end(), t.scalar_type()) != ok.end(), "adam_step: ",
                    where(list, i), " has dtype ", t.scalar_type(), "; expected ", dtypes);
  TORCH_CHECK_VALUE(t.numel() == n, "adam_step: ", where(list, i), " has ", N(t.numel()),
                    " elements; expected ", N(n));
}

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
  J.moments = (int)moments;
  J.has_gs = grad_scale.has_value();
  J.maximize = maximize;
  J.adamw = decoupled;
  J.has_wd = weight_decay != 0.0;
  J.wout = !weights_out.empty();
  const bool bk = !backups.empty();
  J.master_es = mbf16 ? 2 : 4;
  J.state_es = moments == 0 ? 4 : moments == 1 ? 2 : 1;
  if (bk) {
    J.bmaster.resize(T);
    J.bm.resize(T);
    J.bv.resize(T);
    J.bms.resize(T, nullptr);
    J.bvs.resize(T, nullptr);
  }
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
  const bool parity_tail = !mbf16 && moments == 0 && vec_size >= 8;
  int64_t nblocks = 0;
  for (size_t i = 0; i < T; ++i) {
    const int64_t n = masters[i].numel();
    J.master[i] = masters[i].data_ptr();
    J.grad[i] = grads[i].data_ptr();
    J.m[i] = exp_avgs[i].data_ptr();
    J.v[i] = exp_avg_sqs[i].data_ptr();
    if (J.wout) J.wo[i] = weights_out[i].data_ptr();
    if (bk) {
      J.bmaster[i] = backups[per * i].data_ptr();
      J.bm[i] = backups[per * i + 1].data_ptr();
      J.bv[i] = backups[per * i + 2].data_ptr();
      if (moments == 2) {
        J.bms[i] = backups[per * i + 3].data_ptr<float>();
        J.bvs[i] = backups[per * i + 4].data_ptr<float>();
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
    c.lerp_c = c.lerp_small ? w : w - 1.f;
    c.b2 = (float)beta2;
    c.c2 = (float)(1 - beta2);
    c.bc2s = (float)std::sqrt(bc2);
    c.eps = (float)eps;
    c.nss = (float)(-step_size);
    for (int s = 0; s < 3; ++s) {
      const uint64_t k = sr_key(salts[i], step, s);
      c.k[s][0] = (uint32_t)k;
      c.k[s][1] = (uint32_t)(k >> 32);
    }
  }
  J.first_block[T] = nblocks;
  if (nblocks == 0) return;
  const BlockFn fn = pick(mbf16, gbf16, (int)moments, J.wout);
  const bool runs = moments != 2 && !J.has_gs;

  at::parallel_for(0, nblocks, 1, [&](int64_t begin, int64_t end) {
#ifdef OFFLOADOPT_HAVE_MXCSR
    const unsigned int csr = _mm_getcsr();
    if (flush_denormal) _mm_setcsr(csr | 0x8040U);  // FTZ | DAZ
#endif
    size_t i = std::upper_bound(J.first_block.begin(), J.first_block.end(), begin) - J.first_block.begin() - 1;
    for (int64_t b = begin; b < end;) {
      while (b >= J.first_block[i + 1]) ++i;
      // one block, or (fp32/bf16 moments, no grad_scale: nothing kept per block) a run of
      // blocks of this tensor in one loop
      const int64_t run = runs ? std::min({end, J.first_block[i + 1], b + (bk ? BACKUP_RUN : RUN)}) - b : 1;
      const int64_t j0 = (b - J.first_block[i]) * BLOCK;
      if (bk) {  // the run's pre-step values, copied out just before the update reads them
        const int64_t len = std::min(j0 + run * BLOCK, J.numel[i]) - j0;
        backup_copy(static_cast<char*>(J.bmaster[i]) + j0 * J.master_es,
                    static_cast<const char*>(J.master[i]) + j0 * J.master_es, len * J.master_es);
        backup_copy(static_cast<char*>(J.bm[i]) + j0 * J.state_es,
                    static_cast<const char*>(J.m[i]) + j0 * J.state_es, len * J.state_es);
        backup_copy(static_cast<char*>(J.bv[i]) + j0 * J.state_es,
                    static_cast<const char*>(J.v[i]) + j0 * J.state_es, len * J.state_es);
        if (J.moments == 2) {  // int8: one block a call, one scale each
          J.bms[i][j0 / BLOCK] = J.ms[i][j0 / BLOCK];
          J.bvs[i][j0 / BLOCK] = J.vs[i][j0 / BLOCK];
        }
      }
      fn(J, i, j0, j0 + run * BLOCK);
      b += run;
    }
    if (bk) backup_fence();
#ifdef OFFLOADOPT_HAVE_MXCSR
    _mm_setcsr(csr);
#endif
  });
}

int64_t num_threads_used() {
  // how many threads one parallel region over many blocks runs on (a check that the build
  // has OpenMP: without it at::parallel_for runs on one thread)
  std::atomic<int64_t> seen{0};
  at::parallel_for(0, 1 << 16, 1, [&](int64_t, int64_t) { seen.fetch_add(1); });
  return seen.load();
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
  mod.def("set_backup_stream", [](bool on) { g_backup_stream.store(on); },
          "write backups with streaming (non-temporal) stores (default True; False: plain copies)");
}
