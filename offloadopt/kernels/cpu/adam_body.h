// The kernel's body, written once over `struct V` (simd.h): the update and its loops (the int8
// codes' decode and encode: int8_codes.h; the bf16 roundings and the draws' hash: bf16_bits.h).
//
// No include guard: adam_cpu.cpp includes it once per ISA, inside that ISA's namespace, after
// simd.h and after the ISA-free declarations (Job, Coefs, Master, Moments, BLOCK) of
// adam_cpu.cpp. Its one export is `pick`, the span function of a mode.
//
// A span is a run of whole 256-element blocks of one tensor (the last may be short). The
// compressed modes go 2W elements at a time through `Kern::two_pass`, in simd.h's paired order; the
// all-fp32 mode (torch's) one vector at a time through `Kern::one`, in element order. A
// tensor's ragged end (fewer than 2W or W elements, or a short int8 block) is copied into
// zero-padded local arrays, run through the same function, and copied back: the lanes are
// independent, so the bits do not depend on where a vector starts or on the lanes' order.

template <Master MK, bool GBF16, Moments SK, bool WOUT>
struct Kern {
  using F = typename V::F;
  using I = typename V::I;
  using MT = std::conditional_t<MK == Master::Bf16Sr, uint16_t, float>;
  using GT = std::conditional_t<GBF16, uint16_t, float>;
  using ST = std::conditional_t<SK == Moments::Fp32, float,
                                std::conditional_t<SK == Moments::Bf16Sr, uint16_t, uint8_t>>;
  static constexpr int W = V::W;
  // fp32 master and fp32 moments: torch's fused AdamW, bit for bit (the note in adam_cpu.cpp)
  static constexpr bool kParity = MK == Master::Fp32 && SK == Moments::Fp32;

  struct Ctx {
    // the tensor's scalars (Coefs) as vectors
    F gscale, wd, decay, lerp, b2, c2, bc2s, eps, neg_step;
    F m_scale, v_scale;  // int8: the block's scales
    I gsign;             // maximize: the sign bit to flip in g
    bool has_gs, maximize, adamw, l2, lerp_small;
    // stochastic rounding: lo32 of each lane's counter (a pair's two vectors), and the keys
    // (sr_key in cpu/sr_keys.h)
    I lo[2], lo_first, key[2], key_wrapped[2];
    bool wraps;  // lo32 of the counter wraps inside this span (hi32 steps up by one)
    // weights_out (write-only) written with streaming stores when aligned for them: the lines
    // are not read first (2 bytes an element, not 4)
    bool wo_stream;
  };

  static Ctx context(const Job& J, size_t i, int64_t j0, int64_t len) {
    const Coefs& k = J.coefs[i];
    Ctx c;
    c.gscale = V::setf(k.gscale);
    c.wd = V::setf(k.wd);
    c.decay = V::setf(k.decay);
    c.lerp = V::setf(k.lerp);
    c.b2 = V::setf(k.b2);
    c.c2 = V::setf(k.c2);
    c.bc2s = V::setf(k.bc2s);
    c.eps = V::setf(kParity ? k.eps : k.eps_c);
    c.neg_step = V::setf(kParity ? k.neg_step : k.neg_step_c);
    c.m_scale = c.v_scale = V::setf(0.f);
    c.gsign = V::seti(0x80000000u);
    c.has_gs = J.has_gs;
    c.maximize = J.maximize;
    c.adamw = J.has_wd && J.adamw;
    c.l2 = J.has_wd && !J.adamw;
    c.lerp_small = k.lerp_small;
    const uint64_t base = (uint64_t)(J.offsets[i] + j0);
    const uint32_t lo0 = (uint32_t)base, hi0 = (uint32_t)(base >> 32);
    V::iota2(c.lo[0], c.lo[1]);
    c.lo[0] = V::add(V::seti(lo0), c.lo[0]);
    c.lo[1] = V::add(V::seti(lo0), c.lo[1]);
    c.lo_first = V::seti(lo0);
    c.wraps = (uint64_t)lo0 + (uint64_t)len > 0x100000000ULL;
    c.wo_stream = WOUT && reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(J.wo[i]) + j0) %
                              (kParity ? V::kStreamAlign : V::kStreamAlign2) == 0;
    for (int d = 0; d < 2; ++d) {
      c.key[d] = V::seti(draw_key(k.key[d], hi0));
      c.key_wrapped[d] = V::seti(draw_key(k.key[d], hi0 + 1));
    }
    return c;
  }

  // 32 random bits per lane of draw d (0: master, 1: moments); lo: the lanes' counters
  template <bool PLAIN>
  static inline I draw(const Ctx& c, I lo, int d) {
    I key = c.key[d];
    if (!PLAIN && c.wraps) key = V::sel(V::lt_u(lo, c.lo_first), c.key_wrapped[d], key);
    return Bf16::hash(V::bxor(lo, key));
  }

  // The update of W lanes: p (the master), g, m0, v0 in; the new master pn, m, v and y = sqrt(v)
  // out. TAIL: lanes in `tail` use torch's scalar-tail form of exp_avg_sq (all-fp32 mode only;
  // see the note below). PLAIN: the common case, decided once per span (`plain`): no
  // grad_scale, no maximize, no Adam-style weight decay, no counter wrap, beta1 > 0.5
  // (lerp_small); AdamW's decay is a multiplication by 1 - lr*wd (exactly 1.0 without weight
  // decay: p * 1 == p), so the loop has no branch (nor has weights_out's store: STREAM).
  template <bool TAIL, bool PLAIN>
  static inline void math(const Ctx& c, F p, F g, F m0, F v0, typename V::M tail, F& pn, F& m, F& v, F& y) {
    moments<TAIL, PLAIN>(c, grad<PLAIN>(c, g, p), m0, v0, tail, m, v, y);
    pn = step(c, decayed<PLAIN>(c, p), m, y);
  }

  // math's grad: scaled, signed and with Adam's (L2) decay of the master p where asked
  template <bool PLAIN>
  static inline F grad(const Ctx& c, F g, F p) {
    if (!PLAIN) {
      if (c.has_gs) g = V::div(g, c.gscale);
      if (c.maximize) g = V::flt(V::bxor(V::bits(g), c.gsign));
      if (c.l2) g = V::fma(p, c.wd, g);
    }
    return g;
  }

  // math's master before the step: AdamW's decay, p * (1 - lr*wd) (the plain path multiplies
  // by exactly 1.0 without weight decay)
  template <bool PLAIN>
  static inline F decayed(const Ctx& c, F p) {
    return PLAIN || c.adamw ? V::mul(p, c.decay) : p;
  }

  // math's moments: m, v and y = sqrt(v) from g (scaled, signed, decayed as math does), m0, v0
  template <bool TAIL, bool PLAIN>
  static inline void moments(const Ctx& c, F g, F m0, F v0, typename V::M tail, F& m, F& v, F& y) {
    m = V::fma(c.lerp, V::sub(g, m0), PLAIN || c.lerp_small ? m0 : g);
    const F cg = V::mul(c.c2, g);
    // Note [torch parity]: torch._fused_adam(w)_ (fp32 everything) reproduced bit for bit,
    // found element by element against torch 2.13.0+cpu (AVX512, GCC build). Its vector loop is
    // contracted by torch's compiler: Adam decay g = fma(p, wd, g); AdamW p = p * (1 - lr*wd);
    // lerp |w| < 0.5: fma(w, g - m, m), else fma(w - 1, g - m, g); v = fma(c2*g, g, v*b2)
    // ((c2*g) rounded first); p + (-step_size * m) / (sqrt(v) / sqrt(bc2) + eps) (divisions:
    // no FMA). The last numel % 16 elements go through torch's scalar loop, which its compiler
    // vectorizes 8 wide with the same forms and leaves numel % 8 elements scalar, where
    // exp_avg_sq contracts the OTHER way: v = fma(v, b2, (c2*g)*g). So elements from
    // numel - numel % 8 on (Job::tail_start) take that form, the TAIL lanes here; with AVX2
    // (vec_size 8) the rule is the same (inferred: no AVX2-only host was measured); vec_size
    // 4 (no AVX) is not matched. Compressed modes use the vector forms everywhere.
    v = V::fma(cg, g, V::mul(v0, c.b2));
    if constexpr (TAIL) v = V::sel(tail, V::fma(v0, c.b2, V::mul(cg, g)), v);
    y = V::sqrt(v);
  }

  // math's new master from p (decayed as math does), m and y
  static inline F step(const Ctx& c, F p, F m, F y) {
    // all-fp32: torch's p + (-step_size * m) / (sqrt(v) / sqrt(bc2) + eps), two divisions;
    // compressed: the same with sqrt(bc2) folded into the step and eps, one division
    const F denom = kParity ? V::add(V::div(y, c.bc2s), c.eps) : V::add(y, c.eps);
    return V::add(p, V::div(V::mul(c.neg_step, m), denom));
  }

  // weights_out's stores streamed: the plain path decides once per span (STREAM), others per call
  template <bool PLAIN, bool STREAM>
  static inline bool streams(const Ctx& c) {
    return PLAIN ? STREAM : c.wo_stream;
  }

  // The all-fp32 mode (torch's): one vector of W elements at P, G, Ms, Vs (and Wo), in
  // element order.
  template <bool TAIL, bool PLAIN, bool STREAM = false>
  static inline void one(Ctx& c, MT* P, const GT* G, ST* Ms, ST* Vs, uint16_t* Wo, typename V::M tail) {
    static_assert(kParity, "the compressed modes go through two_pass");
    F g;
    if constexpr (GBF16) g = V::ld_bf16(G); else g = V::ldf(G);
    F pn, m, v, y;
    math<TAIL, PLAIN>(c, V::ldf(P), g, V::ldf(Ms), V::ldf(Vs), tail, pn, m, v, y);
    V::stf(P, pn);
    if constexpr (WOUT) {
      if (streams<PLAIN, STREAM>(c))
        V::st_u16_stream(Wo, Bf16::round_ne(pn));
      else
        V::st_u16(Wo, Bf16::round_ne(pn));
    }
    V::stf(Ms, m);
    V::stf(Vs, v);
  }

  // a pair (2W elements, simd.h's paired order) of bf16 or fp32 values
  static inline void ld2(const uint16_t* p, F x[2]) { V::ld2_bf16(p, x[0], x[1]); }
  static inline void ld2(const float* p, F x[2]) { V::ld2f(p, x[0], x[1]); }

  // a pair's new masters pn to P (and weights_out to Wo)
  template <bool PLAIN, bool STREAM>
  static inline void store_master(const Ctx& c, MT* P, uint16_t* Wo, const F pn[2], typename V::M& wnan) {
    if constexpr (MK == Master::Bf16Sr) {
      // one hash for a lane of both vectors (elements j, j + 4): its low 16 bits round pn[0],
      // its high 16 pn[1] (rounding.master_bits)
      const I r = draw<PLAIN>(c, c.lo[0], 0);
      V::st2_u16(P, Bf16::round_sr(pn[0], V::band(r, V::seti(0xFFFFu))), Bf16::round_sr(pn[1], V::template srl<16>(r)));
    } else {
      V::st2f(P, pn[0], pn[1]);
      if constexpr (WOUT) {
        I w0, w1;
        if constexpr (PLAIN) {
          w0 = Bf16::round_ne_num(pn[0]);
          w1 = Bf16::round_ne_num(pn[1]);
          wnan = V::mor(wnan, V::isnan2(pn[0], pn[1]));
        } else {
          w0 = Bf16::round_ne(pn[0]);
          w1 = Bf16::round_ne(pn[1]);
        }
        if (streams<PLAIN, STREAM>(c))
          V::st2_u16_stream(Wo, w0, w1);
        else
          V::st2_u16(Wo, w0, w1);
      }
    }
  }

  // fp32 or bf16 moments: a pair's new m and v to Ms, Vs (bf16: rounded with the pair's draws)
  template <bool PLAIN>
  static inline void store_moments(const Ctx& c, ST* Ms, ST* Vs, const F m[2], const F v[2]) {
    if constexpr (SK == Moments::Fp32) {
      V::st2f(Ms, m[0], m[1]);
      V::st2f(Vs, v[0], v[1]);
    } else if constexpr (SK == Moments::Bf16Sr) {
      // low half: exp_avg, high half: exp_avg_sq
      const I r0 = draw<PLAIN>(c, c.lo[0], 1), r1 = draw<PLAIN>(c, c.lo[1], 1), lo16 = V::seti(0xFFFFu);
      V::st2_u16(Ms, Bf16::round_sr(m[0], V::band(r0, lo16)), Bf16::round_sr(m[1], V::band(r1, lo16)));
      V::st2_u16(Vs, Bf16::round_sr(v[0], V::template srl<16>(r0)), Bf16::round_sr(v[1], V::template srl<16>(r1)));
    }
  }

  // int8: a pair's new m and y = sqrt(v) into the block's Pending (mb, yb: the pair's two
  // vectors one after the other), their magnitudes' bits into the block's maxima mabs, yabs
  static inline void keep(float* mb, float* yb, const F m[2], const F y[2], I& mabs, I& yabs) {
    for (int h = 0; h < 2; ++h) {
      V::stf(mb + h * W, m[h]);
      V::stf(yb + h * W, y[h]);
    }
    // the pair's maxima first, then the block's: one max a pair on the loop-carried chain
    const I abs = V::seti(0x7FFFFFFFu);
    mabs = V::maxu(mabs, V::maxu(V::band(V::bits(m[0]), abs), V::band(V::bits(m[1]), abs)));
    // y = sqrt(v): +0, positive or NaN (a NaN's sign set is still above inf's bits as unsigned)
    yabs = V::maxu(yabs, V::maxu(V::bits(y[0]), V::bits(y[1])));
  }

  // The compressed modes: n elements (a multiple of 2W, at most BLOCK) at P, G, Ms, Vs (and
  // Wo) in two passes, 2W elements (a pair, in simd.h's paired order) at a time. The first
  // updates the moments (int8: decoded from the codes, fp32 or bf16: loaded) and keeps m and
  // y = sqrt(v) in mb, yb (L1; int8's Pending, whose codes `encode` writes once the block's
  // scales are known, from the maxima mabs, yabs); the second reads them back and updates the
  // masters. In one pass the chain of a pair ran from its moments' load through sqrt and the
  // division to weights_out's store, about 60 cycles, and the out-of-order window held about
  // two pairs of it: the loop waited on latency, not on its instructions (AVX2, one Zen 4
  // core: 10-17% less time in two passes, with 2-19% more instructions). The draws keep their
  // counters: the moments' from lo[0] and lo[1] in the first pass, the bf16 master's from
  // lo[0] again in the second. The plain path rounds weights_out without its NaN case and
  // marks NaN lanes in wnan: the caller redoes weights_out from the stored masters where any
  // is set (fix_wo), two instructions a pair less.
  template <bool PLAIN, bool STREAM, bool FINITE>
  static inline void two_pass(Ctx& c, MT* P, const GT* G, ST* Ms, ST* Vs, uint16_t* Wo, float* mb, float* yb,
                              int n, I& mabs, I& yabs, typename V::M& wnan) {
    static_assert(!kParity, "the all-fp32 mode goes through one");
    const I lo0 = c.lo[0];
    for (int k = 0; k < n; k += 2 * W) {
      F m0[2], v0[2], g[2], m[2], v[2], y[2], p[2] = {V::setf(0.f), V::setf(0.f)};
      if constexpr (SK == Moments::Int8Block) {
        Int8Codes::decode<FINITE>(c.m_scale, c.v_scale, Ms + k, Vs + k, m0, v0);
      } else {
        ld2(Ms + k, m0);
        ld2(Vs + k, v0);
      }
      ld2(G + k, g);
      if (!PLAIN && c.l2) ld2(P + k, p);  // Adam's decay: the grad takes the master
      for (int h = 0; h < 2; ++h)
        moments<false, PLAIN>(c, grad<PLAIN>(c, g[h], p[h]), m0[h], v0[h], V::lanes_from(W), m[h], v[h], y[h]);
      if constexpr (SK == Moments::Int8Block) {
        keep(mb + k, yb + k, m, y, mabs, yabs);
      } else {
        store_moments<PLAIN>(c, Ms + k, Vs + k, m, v);
        for (int h = 0; h < 2; ++h) {
          V::stf(mb + k + h * W, m[h]);
          V::stf(yb + k + h * W, y[h]);
        }
      }
      if constexpr (SK == Moments::Bf16Sr) {
        c.lo[0] = V::add(c.lo[0], V::seti((uint32_t)(2 * W)));
        c.lo[1] = V::add(c.lo[1], V::seti((uint32_t)(2 * W)));
      }
    }
    if constexpr (MK == Master::Bf16Sr) c.lo[0] = lo0;
    for (int k = 0; k < n; k += 2 * W) {
      F p[2], pn[2];
      ld2(P + k, p);
      for (int h = 0; h < 2; ++h)
        pn[h] = step(c, decayed<PLAIN>(c, p[h]), V::ldf(mb + k + h * W), V::ldf(yb + k + h * W));
      store_master<PLAIN, STREAM>(c, P + k, WOUT ? Wo + k : nullptr, pn, wnan);
      if constexpr (MK == Master::Bf16Sr) c.lo[0] = V::add(c.lo[0], V::seti((uint32_t)(2 * W)));
    }
  }

  // weights_out of n elements (a multiple of 2W) again from the stored masters, with round_ne's
  // NaN case: after plain pairs that marked a NaN (two_pass)
  static void fix_wo(const MT* P, uint16_t* Wo, int64_t n) {
    for (int64_t k = 0; k < n; k += 2 * W) {
      F p[2];
      ld2(P + k, p);
      V::st2_u16(Wo + k, Bf16::round_ne(p[0]), Bf16::round_ne(p[1]));
    }
  }

  // int8's two passes a block: int8_codes.h
  using Pending = Int8Codes::Pending;

  template <bool PLAIN, bool STREAM = false>
  static void update_block(Ctx& c, MT* P, const GT* G, uint8_t* Ms, uint8_t* Vs, uint16_t* Wo, float* msc,
                           float* vsc, Pending& out) {
    c.m_scale = V::setf(*msc);
    c.v_scale = V::setf(*vsc);
    I mabs = V::seti(0u), yabs = V::seti(0u);
    typename V::M wnan = V::none();
    if (std::isfinite(*msc))
      two_pass<PLAIN, STREAM, true>(c, P, G, Ms, Vs, Wo, out.m, out.y, BLOCK, mabs, yabs, wnan);
    else
      two_pass<PLAIN, STREAM, false>(c, P, G, Ms, Vs, Wo, out.m, out.y, BLOCK, mabs, yabs, wnan);
    if constexpr (WOUT && PLAIN)
      if (V::any(wnan)) fix_wo(P, Wo, BLOCK);
    const uint32_t ma = V::hmaxu(mabs), ya = V::hmaxu(yabs);
    out.Ms = Ms;
    out.Vs = Vs;
    out.bad = ma >= 0x7F800000u || ya >= 0x7F800000u;
    if (out.bad) {  // NaN scales, codes 0: the problem shows instead of hiding (formats.py)
      *msc = NAN;
      *vsc = NAN;
      return;
    }
    // a subnormal absmax (below 2^-126, where 1/scale overflows to inf): a zero block, its
    // values flushed as flush-to-zero flushes them (formats.py)
    const float ms = ma < 0x00800000u ? 0.f : u2f(ma), ys = ya < 0x00800000u ? 0.f : u2f(ya);
    *msc = ms;
    *vsc = ys;
    // t = |m| * (1/scale): one division a block (a zero block: scale 0, t = |m| < 2^-126, codes 0)
    out.minv = ms == 0.f ? 1.f : 1.f / ms;
    out.yinv = ys == 0.f ? 1.f : 1.f / ys;
  }

  // The last len (< BLOCK) elements of a tensor, as one zero-padded block.
  static void short_block(Ctx& c, MT* P, const GT* G, uint8_t* Ms, uint8_t* Vs, uint16_t* Wo, float* msc,
                          float* vsc, int len) {
    alignas(64) MT p[BLOCK] = {};
    alignas(64) GT g[BLOCK] = {};
    alignas(64) uint8_t m[BLOCK] = {}, v[BLOCK] = {};
    alignas(64) uint16_t w[BLOCK];
    Pending pending;
    std::memcpy(p, P, len * sizeof(MT));
    std::memcpy(g, G, len * sizeof(GT));
    std::memcpy(m, Ms, len);
    std::memcpy(v, Vs, len);
    const bool stream = c.wo_stream;
    c.wo_stream = false;  // the local copy is read back at once
    update_block<false>(c, p, g, m, v, w, msc, vsc, pending);
    c.wo_stream = stream;
    Int8Codes::encode(pending);
    std::memcpy(P, p, len * sizeof(MT));
    std::memcpy(Ms, m, len);
    std::memcpy(Vs, v, len);
    if constexpr (WOUT) std::memcpy(Wo, w, len * 2);
  }

  // The last len (< N: W for the all-fp32 mode, 2W for the others) elements of a tensor, as
  // zero-padded local arrays; all-fp32: lanes >= tail_from take the scalar-tail form.
  template <int N>
  static void short_run(Ctx& c, MT* P, const GT* G, ST* Ms, ST* Vs, uint16_t* Wo, int len, int tail_from) {
    alignas(64) MT p[N] = {};
    alignas(64) GT g[N] = {};
    alignas(64) ST m[N] = {}, v[N] = {};
    alignas(64) uint16_t w[N];
    std::memcpy(p, P, len * sizeof(MT));
    std::memcpy(g, G, len * sizeof(GT));
    std::memcpy(m, Ms, len * sizeof(ST));
    std::memcpy(v, Vs, len * sizeof(ST));
    c.wo_stream = false;  // the local copy is read back at once (and this is the span's end)
    if constexpr (kParity) {
      if (tail_from < W)
        one<true, false>(c, p, g, m, v, w, V::lanes_from(tail_from));
      else
        one<false, false>(c, p, g, m, v, w, V::lanes_from(W));
    } else {
      I unused = V::seti(0u);
      alignas(64) float mb[N], yb[N];
      typename V::M no_wnan = V::none();  // not the plain path: NaN rounded in the pass
      two_pass<false, false, true>(c, p, g, m, v, w, mb, yb, N, unused, unused, no_wnan);
    }
    std::memcpy(P, p, len * sizeof(MT));
    std::memcpy(Ms, m, len * sizeof(ST));
    std::memcpy(Vs, v, len * sizeof(ST));
    if constexpr (WOUT) std::memcpy(Wo, w, len * 2);
  }

  // Elements [j0, j0 + len) of tensor i; j0 a multiple of BLOCK.
  static void span(const Job& J, size_t i, int64_t j0, int64_t len) {
    Ctx c = context(J, i, j0, len);
    const bool plain = !c.has_gs && !c.maximize && !c.l2 && !c.wraps && c.lerp_small;
    if (!plain)
      span_loop<false, false>(J, c, i, j0, len);
    else if (WOUT && c.wo_stream)
      span_loop<true, WOUT>(J, c, i, j0, len);  // <true, true>: instantiated only with weights_out
    else
      span_loop<true, false>(J, c, i, j0, len);
  }

  template <bool PLAIN, bool STREAM>
  static void span_loop(const Job& J, Ctx& c, size_t i, int64_t j0, int64_t len) {
    MT* P = static_cast<MT*>(J.master[i]) + j0;
    const GT* G = static_cast<const GT*>(J.grad[i]) + j0;
    ST* Ms = static_cast<ST*>(J.m[i]) + j0;
    ST* Vs = static_cast<ST*>(J.v[i]) + j0;
    uint16_t* Wo = WOUT ? static_cast<uint16_t*>(J.wo[i]) + j0 : nullptr;
    if constexpr (SK == Moments::Int8Block) {
      float* msc = J.ms[i] + j0 / BLOCK;
      float* vsc = J.vs[i] + j0 / BLOCK;
      Pending pending[2];
      int64_t n = 0;
      for (int64_t b = 0; b < len; b += BLOCK, ++msc, ++vsc, ++n) {
        uint16_t* wo = WOUT ? Wo + b : nullptr;
        if (len - b >= BLOCK) {
          update_block<PLAIN, STREAM>(c, P + b, G + b, Ms + b, Vs + b, wo, msc, vsc, pending[n & 1]);
          Int8Codes::encode(pending[(n + 1) & 1]);  // the block before
        } else {
          Int8Codes::encode(pending[(n + 1) & 1]);
          short_block(c, P + b, G + b, Ms + b, Vs + b, wo, msc, vsc, (int)(len - b));
        }
      }
      Int8Codes::encode(pending[(n + 1) & 1]);
      Int8Codes::encode(pending[n & 1]);
    } else if constexpr (kParity) {
      int64_t k = 0;
      for (; k + W <= len; k += W)
        one<false, PLAIN, STREAM>(c, P + k, G + k, Ms + k, Vs + k, WOUT ? Wo + k : nullptr, V::lanes_from(W));
      if (k < len) {
        const int64_t tail_from = std::max<int64_t>(0, J.tail_start[i] - (j0 + k));
        short_run<W>(c, P + k, G + k, Ms + k, Vs + k, WOUT ? Wo + k : nullptr, (int)(len - k),
                     (int)std::min<int64_t>(tail_from, W));
      }
    } else {
      I unused = V::seti(0u);
      typename V::M wnan = V::none();
      alignas(64) float mb[BLOCK], yb[BLOCK];
      int64_t k = 0;
      for (int n; (n = (int)std::min<int64_t>(BLOCK, (len - k) / (2 * W) * (2 * W))) > 0; k += n)
        two_pass<PLAIN, STREAM, true>(c, P + k, G + k, Ms + k, Vs + k, WOUT ? Wo + k : nullptr, mb, yb, n, unused,
                                      unused, wnan);
      if constexpr (WOUT && PLAIN)
        if (V::any(wnan)) fix_wo(P, Wo, k);
      if (k < len) short_run<2 * W>(c, P + k, G + k, Ms + k, Vs + k, WOUT ? Wo + k : nullptr, (int)(len - k), W);
    }
  }
};

template <Master MK, bool GBF16>
SpanFn pick_moments(Moments s, bool wout) {
  if (s == Moments::Fp32) return wout ? Kern<MK, GBF16, Moments::Fp32, true>::span : Kern<MK, GBF16, Moments::Fp32, false>::span;
  if (s == Moments::Bf16Sr) return wout ? Kern<MK, GBF16, Moments::Bf16Sr, true>::span : Kern<MK, GBF16, Moments::Bf16Sr, false>::span;
  return wout ? Kern<MK, GBF16, Moments::Int8Block, true>::span : Kern<MK, GBF16, Moments::Int8Block, false>::span;
}

// The span function of a mode (weights_out only with fp32 masters).
SpanFn pick(Master mk, bool gbf16, Moments s, bool wout) {
  if (mk == Master::Bf16Sr) return gbf16 ? pick_moments<Master::Bf16Sr, true>(s, false) : pick_moments<Master::Bf16Sr, false>(s, false);
  return gbf16 ? pick_moments<Master::Fp32, true>(s, wout) : pick_moments<Master::Fp32, false>(s, wout);
}
