// The GGUF block types csrc/kq_gemm.cpp computes on, as traits (their packed layout:
// kq_gemm.cpp's header comment; kq_pack.cpp writes it from the file's blocks).
#pragma once

#include <cstdint>

namespace kq {

template <int64_t SB_, int64_t SUB_, int P_, int OFF_, bool SCALES_, bool SIGNED_, bool MINS_, const char* NAME>
struct Fmt {
  static constexpr const char* kName = NAME;
  static constexpr int64_t SB = SB_;    // inputs a super-block (one d, one activation scale)
  static constexpr int64_t SUB = SUB_;  // inputs a sub-block (one sc, mn)
  static constexpr int P = P_;          // high bits kept as masks
  static constexpr int OFF = OFF_;      // q - OFF
  static constexpr bool SCALES = SCALES_, SIGNED = SIGNED_, MINS = MINS_;
  static constexpr int64_t NSUB = SB / SUB;
  static constexpr int64_t SC_AT = MINS ? 64 : 32;              // header: d [, dmin], sc [, mn]
  static constexpr int64_t MN_AT = SC_AT + (SCALES ? 16 * NSUB : 0);
  static constexpr int64_t HEADER = MN_AT + (MINS ? 16 * NSUB : 0);
  static constexpr int64_t CHUNK = 256 + 64 * P;
  static constexpr int64_t BYTES = HEADER + SB / 32 * CHUNK;  // a super-block of 16 outputs
};
inline constexpr char kQ4_0Name[] = "Q4_0", kQ5_0Name[] = "Q5_0", kQ4_KName[] = "Q4_K", kQ5_KName[] = "Q5_K",
                      kQ6_KName[] = "Q6_K";
using Q4_0 = Fmt<32, 32, 0, 8, false, false, false, kQ4_0Name>;
using Q5_0 = Fmt<32, 32, 1, 16, false, false, false, kQ5_0Name>;
using Q4_K = Fmt<256, 32, 0, 0, true, false, true, kQ4_KName>;
using Q5_K = Fmt<256, 32, 1, 0, true, false, true, kQ5_KName>;
using Q6_K = Fmt<256, 16, 2, 32, true, true, false, kQ6_KName>;

}  // namespace kq
