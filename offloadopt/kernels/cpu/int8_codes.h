// int8 block moments (formats.py): the decode of a pair of vectors' codes, and the encode of a
// whole block once its scales are known. The update of a block, which writes the fresh
// moments into `Pending`, is `Kern`'s (adam_body.h).
//
// No include guard: adam_cpu.cpp includes it once per ISA, inside that ISA's namespace, after
// simd.h and the ISA-free declarations (BLOCK), before adam_body.h.

struct Int8Codes {
  using F = V::F;
  using I = V::I;
  static constexpr int W = V::W;

  // int8 works a block in two passes: `update_block` updates it and keeps the fresh m and y =
  // sqrt(v) in an L1 buffer (`Pending`), with the block's new scales; `encode` writes their
  // codes. The span runs the encode of block b after the update of block b + 1: the encode
  // waits for its block's absmax (a reduction and a division), and the next block's update,
  // independent of it, fills that wait.
  struct Pending {
    alignas(64) float m[BLOCK];
    alignas(64) float y[BLOCK];
    uint8_t* Ms = nullptr;  // where the codes go (nullptr: nothing pending)
    uint8_t* Vs = nullptr;
    float minv = 1.f, yinv = 1.f;  // 1 / the scales (1 for a zero block)
    bool bad = false;               // inf or NaN in the block: codes 0
  };

  // The moments of the 2W elements at Ms, Vs, in the paired order (formats.py: m = +-scale
  // * 2^(e-15) * (1 + f/8), v = (scale * 2^(e-15) * (1 + f/16))^2). A code's value is a bf16
  // pattern (m: sign << 15 | (mag + 112 << 3) << 4, v: (code + 112 << 4) << 3; 0 for a zero
  // magnitude), built in 16-bit lanes, 2W at a time. FINITE (the block's exp_avg scale m_scale): the sign goes
  // into the pattern (scale * -x == -(scale * x) unless the product is NaN); otherwise it is
  // flipped after the product, as formats.decode_m does (a NaN's sign then matches).
  template <bool FINITE>
  static inline void decode(F m_scale, F v_scale, const uint8_t* Ms, const uint8_t* Vs, F* m0, F* v0) {
    using H = V::H;
    if constexpr (FINITE) {
      const H x = V::template sll16<4>(V::ld_s8h(Ms));  // sign in bits 15..11, mag << 4
      const H b = V::addnz16(V::and16(x, V::set16(0x87F0)), V::and16(x, V::set16(0x07F0)), V::set16(112u << 7));
      m0[0] = V::mul(m_scale, V::flt(V::hi16_lo(b)));
      m0[1] = V::mul(m_scale, V::flt(V::hi16_hi(b)));
    } else {
      const H cmh = V::ld_u8h(Ms);
      for (int h = 0; h < 2; ++h) {
        const I cm = V::template srl<16>(h ? V::hi16_hi(cmh) : V::hi16_lo(cmh)), mag = V::band(cm, V::seti(0x7Fu));
        const I mbits = V::keep_nonzero(mag, V::template sll<20>(V::add(mag, V::seti(112u << 3))));
        const I msign = V::band(V::template sll<24>(cm), V::seti(0x80000000u));
        m0[h] = V::flt(V::bxor(V::bits(V::mul(m_scale, V::flt(mbits))), msign));
      }
    }
    const H cv = V::ld_u8h(Vs);
    const H b = V::addnz16(V::template sll16<3>(cv), cv, V::set16(112u << 7));
    const F s0 = V::mul(v_scale, V::flt(V::hi16_lo(b))), s1 = V::mul(v_scale, V::flt(V::hi16_hi(b)));
    v0[0] = V::mul(s0, s0);
    v0[1] = V::mul(s1, s1);
  }

  // The codes of a pending block (formats.py: round to nearest, ties up, on t's fp32 bits).
  static void encode(Pending& b) {
    if (!b.Ms) return;
    uint8_t* Ms = b.Ms;
    uint8_t* Vs = b.Vs;
    b.Ms = b.Vs = nullptr;
    if (b.bad) {
      std::memset(Ms, 0, BLOCK);
      std::memset(Vs, 0, BLOCK);
      return;
    }
    const F minv = V::setf(b.minv), yinv = V::setf(b.yinv);
    // two pairs at a time (their bytes pack in four instructions, not eight); t <= 1
    // (a finite 1/scale: the scale is 0 or normal), so every code fits 8 bits
    for (int k = 0; k < BLOCK; k += 4 * W) {
      I cm[4];
      for (int u = 0; u < 4; ++u) cm[u] = m_code(V::ldf(b.m + k + u * W), minv);
      V::st_u8x4(Ms + k, cm[0], cm[1], cm[2], cm[3]);
    }
    for (int k = 0; k < BLOCK; k += 4 * W) {
      I rv[4], yb[4];
      for (int u = 0; u < 4; ++u) {
        const F y = V::ldf(b.y + k + u * W);
        rv[u] = v_round(y, yinv);
        yb[u] = V::bits(y);
      }
      // in bytes, 4W at a time: at least 1, and 0 where y == 0 (v_round)
      const auto rb = V::pack8(rv[0], rv[1], rv[2], rv[3]), ybb = V::pack8(yb[0], yb[1], yb[2], yb[3]);
      V::st_u8(Vs + k, V::minu8(V::maxu8(rb, V::set8(1)), ybb));
    }
  }

  // exp_avg's code of m, t = |m| * minv (formats.py): round to nearest, ties up, on t's bits
  // (add half, shift), less the bias 896 = 112 << 3 (folded into the constant: the shift is
  // arithmetic, a floor), | the sign. Below 0 (t rounds below 2^-15) the lane stays negative
  // whatever the sign: st_u8x4's saturation writes 0. t's bits < 2^31 (t <= 1 + 2 ulps).
  static inline I m_code(F m, F minv) {
    const I mbits = V::bits(m);
    const I tm = V::bits(V::mul(V::flt(V::band(mbits, V::seti(0x7FFFFFFFu))), minv));
    const I mag = V::template sra<20>(V::add(tm, V::seti(0x80000u - (896u << 20))));
    return V::bor(mag, V::band(V::template srl<24>(mbits), V::seti(0x80u)));
  }

  // exp_avg_sq's code of y = sqrt(v), t = y * yinv, before the clamp: rounded as m's (bias 1792 =
  // 112 << 4). encode then takes y != 0 to at least 1 and y == 0 to 0, in bytes: min(max(code,
  // 1), y's bits clamped to 0..255), as y's bits are 0 for y = +0 and >= 1 for any other y (y
  // is never -0: v = x*x + ...)
  static inline I v_round(F y, F yinv) {
    return V::template sra<19>(V::add(V::bits(V::mul(y, yinv)), V::seti(0x40000u - (1792u << 19))));
  }
};
