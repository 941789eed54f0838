// GGUF blocks -> the packed layout kq_gemm.cpp reads (its header comment), once at load
// (formats.pack_kquant): one pass over the weight's bytes, groups of 16 outputs shared
// out over the threads. (The same in torch ops took 3.7 s of a 1B Q4_K_M's 6.4 s load.)
// The file's blocks as gguf-py reads them (model/quantization.py kquant_fields is the
// same in torch, for the dequantized reference).
#include <torch/extension.h>

#include "kq_formats.h"
#include "no_gil.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

namespace kq_packing {

// One file block's fields: q the unsigned integers of its SB inputs, d and dmin float16
// bits, sc (a byte, Q6_K's signed) and mn of each sub-block. A padding row is all zeros.
template <class F>
struct Block {
  uint8_t q[F::SB] = {};
  uint16_t d = 0, dmin = 0;
  uint8_t sc[F::NSUB] = {}, mn[F::NSUB] = {};
};

template <class F>
constexpr int64_t file_bytes() {  // a file block (ggml's type sizes)
  if constexpr (std::is_same_v<F, kq::Q4_0>) return 18;
  else if constexpr (std::is_same_v<F, kq::Q5_0>) return 22;
  else if constexpr (std::is_same_v<F, kq::Q4_K>) return 144;
  else if constexpr (std::is_same_v<F, kq::Q5_K>) return 176;
  else return 210;
}

inline uint16_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

template <class F>
void unpack(const uint8_t* b, Block<F>& o) {
  if constexpr (std::is_same_v<F, kq::Q4_0> || std::is_same_v<F, kq::Q5_0>) {
    // d, [Q5_0: 32 high bits], 16 bytes: input k < 16 the low nibble of byte k, k >= 16 the high one of k - 16
    constexpr bool five = std::is_same_v<F, kq::Q5_0>;
    o.d = u16(b);
    uint32_t qh = 0;
    if constexpr (five) std::memcpy(&qh, b + 2, 4);
    const uint8_t* qs = b + (five ? 6 : 2);
    for (int k = 0; k < 16; ++k) {
      o.q[k] = static_cast<uint8_t>((qs[k] & 15) | (((qh >> k) & 1) << 4));
      o.q[k + 16] = static_cast<uint8_t>((qs[k] >> 4) | (((qh >> (k + 16)) & 1) << 4));
    }
  } else if constexpr (std::is_same_v<F, kq::Q4_K> || std::is_same_v<F, kq::Q5_K>) {
    // d, dmin, 12 bytes of 6-bit sc / mn, [Q5_K: 32 bytes of high bits], 128 bytes: per 64 inputs
    // 32 bytes, the first 32 inputs their low nibbles, the next 32 their high ones
    constexpr bool five = std::is_same_v<F, kq::Q5_K>;
    o.d = u16(b);
    o.dmin = u16(b + 2);
    const uint8_t* s = b + 4;
    for (int i = 0; i < 4; ++i) {
      o.sc[i] = s[i] & 63;
      o.mn[i] = s[4 + i] & 63;
      o.sc[4 + i] = static_cast<uint8_t>((s[8 + i] & 15) | ((s[i] >> 2) & 0x30));
      o.mn[4 + i] = static_cast<uint8_t>((s[8 + i] >> 4) | ((s[4 + i] >> 2) & 0x30));
    }
    const uint8_t* qs = b + (five ? 48 : 16);
    for (int i = 0; i < 4; ++i)
      for (int k = 0; k < 32; ++k) {
        o.q[64 * i + k] = qs[32 * i + k] & 15;
        o.q[64 * i + 32 + k] = qs[32 * i + k] >> 4;
      }
    if constexpr (five)  // bit s of byte i: input 32 s + i
      for (int sh = 0; sh < 8; ++sh)
        for (int i = 0; i < 32; ++i) o.q[32 * sh + i] |= static_cast<uint8_t>(((b[16 + i] >> sh) & 1) << 4);
  } else {
    static_assert(std::is_same_v<F, kq::Q6_K>);
    // 128 bytes of low nibbles (per 128 inputs 64 bytes, low then high nibbles), 64 bytes of
    // 2-bit highs (per 128 inputs 32 bytes: bits 2 s of byte i, input 32 s + i), 16 int8 sc, d
    const uint8_t *ql = b, *qh = b + 128;
    for (int h = 0; h < 2; ++h) {
      for (int k = 0; k < 64; ++k) {
        o.q[128 * h + k] = ql[64 * h + k] & 15;
        o.q[128 * h + 64 + k] = ql[64 * h + k] >> 4;
      }
      for (int sh = 0; sh < 4; ++sh)
        for (int i = 0; i < 32; ++i)
          o.q[128 * h + 32 * sh + i] |= static_cast<uint8_t>(((qh[32 * h + i] >> (2 * sh)) & 3) << 4);
    }
    std::memcpy(o.sc, b + 192, 16);
    o.d = u16(b + 208);
  }
}

// Super-block sb of group g's 16 rows (blk[j]) into dst, F::BYTES bytes.
template <class F>
void write(const Block<F> (&blk)[16], uint8_t* dst) {
  for (int j = 0; j < 16; ++j) {
    std::memcpy(dst + 2 * j, &blk[j].d, 2);
    if constexpr (F::MINS) std::memcpy(dst + 32 + 2 * j, &blk[j].dmin, 2);
    if constexpr (F::SCALES)
      for (int64_t s = 0; s < F::NSUB; ++s) dst[F::SC_AT + 16 * s + j] = blk[j].sc[s];
    if constexpr (F::MINS)
      for (int64_t p = 0; p < F::NSUB / 2; ++p)
        for (int t = 0; t < 2; ++t) dst[F::MN_AT + 32 * p + 2 * j + t] = blk[j].mn[2 * p + t];
  }
  for (int64_t c = 0; c < F::SB / 32; ++c) {
    uint8_t* chunk = dst + F::HEADER + c * F::CHUNK;
    for (int kk = 0; kk < 4; ++kk) {
      const int64_t k0 = 32 * c + 8 * kk;
      for (int j = 0; j < 16; ++j)
        for (int t = 0; t < 4; ++t)
          chunk[64 * kk + 4 * j + t] = static_cast<uint8_t>((blk[j].q[k0 + t] & 15) | ((blk[j].q[k0 + 4 + t] & 15) << 4));
      for (int bit = 0; bit < F::P; ++bit)
        for (int h = 0; h < 2; ++h) {
          uint64_t mask = 0;
          for (int j = 0; j < 16; ++j)
            for (int t = 0; t < 4; ++t)
              mask |= static_cast<uint64_t>((blk[j].q[k0 + 4 * h + t] >> (4 + bit)) & 1) << (4 * j + t);
          std::memcpy(chunk + 256 + 16 * F::P * kk + 16 * bit + 8 * h, &mask, 8);
        }
    }
  }
}

template <class F>
void pack(const at::Tensor& blocks, const at::Tensor& out) {
  const int64_t n = blocks.size(0), nb = blocks.size(1), groups = (n + 15) / 16;
  TORCH_CHECK(blocks.size(2) == file_bytes<F>(), F::kName, " blocks are ", file_bytes<F>(), " bytes, got ",
              blocks.size(2));
  TORCH_CHECK(out.dim() == 3 && out.size(0) == groups && out.size(1) == nb && out.size(2) == F::BYTES &&
                  out.is_contiguous(),
              "kq_pack: out must be uint8 [", groups, ", ", nb, ", ", F::BYTES, "] contiguous");
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; ++g) {
    Block<F> blk[16];
    for (int64_t sb = 0; sb < nb; ++sb) {
      for (int j = 0; j < 16; ++j) {
        const int64_t row = 16 * g + j;
        if (row < n) unpack<F>(src + (row * nb + sb) * file_bytes<F>(), blk[j]);
        else blk[j] = Block<F>{};
      }
      write<F>(blk, dst + (g * nb + sb) * F::BYTES);
    }
  }
}

}  // namespace kq_packing

// GGUF blocks of type `fmt` (uint8 [N, K / SB, file block bytes]) packed into `out`
// (uint8 [ceil(N / 16), K / SB, kq::F::BYTES], formats.pack_kquant allocates it).
void kq_pack(const std::string& fmt, at::Tensor blocks, at::Tensor out) {
  NoGil no_gil;
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == at::kByte && out.scalar_type() == at::kByte,
              "kq_pack: uint8 blocks [N, K / SB, bytes] and uint8 out");
  blocks = blocks.contiguous();
  if (fmt == "Q4_0") kq_packing::pack<kq::Q4_0>(blocks, out);
  else if (fmt == "Q5_0") kq_packing::pack<kq::Q5_0>(blocks, out);
  else if (fmt == "Q4_K") kq_packing::pack<kq::Q4_K>(blocks, out);
  else if (fmt == "Q5_K") kq_packing::pack<kq::Q5_K>(blocks, out);
  else if (fmt == "Q6_K") kq_packing::pack<kq::Q6_K>(blocks, out);
  else TORCH_CHECK(false, "kq_pack: no packer for ", fmt, " (Q4_0, Q5_0, Q4_K, Q5_K, Q6_K)");
}
