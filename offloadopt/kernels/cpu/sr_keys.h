// The stochastic rounding's keys (ISA-free; adam_cpu.cpp includes this inside its anonymous
// namespace): one 64-bit key per (salt, step, draw), mixed with a counter's high word into the
// 32-bit word a draw xors in. kernels/reference.py computes the same keys in Python.
#pragma once

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// The 64-bit key of one (salt, step, draw) (reference.sr_key)
inline uint64_t sr_key(int64_t salt, double step, int draw) {
  uint64_t s = (uint64_t)(int64_t)step;
  return mix64((uint64_t)salt + 0x9E3779B97F4A7C15ULL * (4 * s + (uint64_t)draw + 1));
}

// The 32-bit word a draw xors into lo32(counter) for counters with this hi32 (reference.sr_bits)
inline uint32_t draw_key(uint64_t key, uint32_t hi) { return (uint32_t)key ^ (hi * 0x9E3779B9u + (uint32_t)(key >> 32)); }

inline float u2f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
