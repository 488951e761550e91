// bf16 bits from fp32 lanes, and the stochastic rounding's hash (kernels/rounding.py is the
// spec): per ISA, over `struct V` (simd.h).
//
// No include guard: adam_cpu.cpp includes it once per ISA, inside that ISA's namespace, after
// simd.h, before adam_body.h.

struct Bf16 {
  using F = V::F;
  using I = V::I;

  // 32 random bits per lane from x = the lane's counter xor the draw's key: a 32-bit integer
  // hash (two multiply-xorshift rounds)
  static inline I hash(I x) {
    x = V::bxor(x, V::template srl<16>(x));
    x = V::mullo(x, V::seti(0x7FEB352Du));
    x = V::bxor(x, V::template srl<15>(x));
    x = V::mullo(x, V::seti(0x846CA68Bu));
    return V::bxor(x, V::template srl<16>(x));
  }

  // fp32 -> bf16 bits (low half of each lane): stochastic rounding with 16 random bits r16
  static inline I round_sr(F x, I r16) {
    I out = V::template srl<16>(V::add(V::bits(x), r16));
    return V::sel(V::isnan(x), V::seti(0x7FC0u), out);
  }

  // fp32 -> bf16 bits, round to nearest even (torch's .to(torch.bfloat16)); round_ne_num leaves
  // out the NaN case (a NaN lane's bits are wrong: the plain path's pairs redo those, fix_wo)
  static inline I round_ne_num(F x) {
    I u = V::bits(x);
    I lsb = V::band(V::template srl<16>(u), V::seti(1u));
    return V::template srl<16>(V::add(V::add(u, V::seti(0x7FFFu)), lsb));
  }
  static inline I round_ne(F x) { return V::sel(V::isnan(x), V::seti(0x7FC0u), round_ne_num(x)); }
};
