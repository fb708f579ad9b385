// Linear layers over GGUF-quantized weights kept as their packed blocks, for CPUs.
//
//   qlinear(out, x, w):  out[m, n] = sum_k x[m, k] * W[n, k]
//   dequantize(out, w):  out[n, k] = W[n, k]
//
// W is the checkpoint's bytes as stored: row n is K / block_elems blocks of llama.cpp's
// layout (Q8_0, Q4_0, Q4_1: 32 elements per block; Q4_K, Q6_K: 256 per super-block). A
// weight is dequantized 8 (or 16) elements at a time in registers, with the same float32
// operations in the same order as gguf-py's numpy reference, so a dequantized element is
// bit-identical to the float32 checkpoint's.
//
// Two kernels (the launcher picks by the number of input rows, QuantLinear.FUSED_ROWS):
//
// fused (few rows: decode at small batch). Work is split over output columns (rows of W):
// each weight byte is read once per call. A chunk of W is dequantized in registers and
// shared by up to MR input rows. It takes each chunk's scale (and min) out of its sum where
// the type has one per 32 elements (Q8_0, Q4_0, Q4_1, Q4_K): sum(x w) = d sum(x q) + m sum(x).
//
// tiled (more rows: decode batches, prompts). A few rows of W are dequantized into a small
// float32 tile in L1, and a register-blocked kernel runs every input row against it: each
// weight element is dequantized once per panel of TM input rows, each tile value loaded
// once per TX rows. This is what replaced dequantizing the whole weight and calling torch's
// GEMM: no dense copy, and faster than that GEMM at these shapes (docs/benchmarks.md).
//
// Both add a product's terms in an order fixed by K alone, so a row's output does not
// depend on the other rows of the batch or on the thread count (within one kernel and one
// build: where the CPU has AVX-512 the tiled kernel runs 16-wide, which orders a sum's
// float32 additions differently from an AVX2 build's).
//
// Shapes and dtypes are checked by the Python launcher (kernels/quant_linear.py):
//   x   [M, K]                 float32, contiguous
//   w   [N, K / be * bytes]    uint8,   contiguous
//   out [M, N] or [N, K]       float32, contiguous
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PDSERVE_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512VL__)
#define PDSERVE_AVX512 1  // the tiled kernel's tile and passes 16 wide, 32 vector registers
#endif
#endif

namespace {

// ggml's type ids (gguf.GGMLQuantizationType).
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

constexpr int64_t MR = 8;  // input rows sharing one dequantized vector
constexpr int64_t PREFETCH = 1024;  // bytes ahead of the weight read

struct Layout {
  int64_t elems;  // elements per block
  int64_t bytes;  // bytes per block
};

constexpr Layout layout_of(int64_t t) {
  switch (t) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q6_K: return {256, 210};
    default: return {0, 0};
  }
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: renormalise
    int e = -1;
    uint32_t m = man;
    do {
      ++e;
      m <<= 1;
    } while ((m & 0x400) == 0);
    bits = sign | ((112 - e) << 23) | ((m & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Q4_K's 6-bit scale and min of sub-block j (0..7) from its 12 packed bytes.
inline void q4k_scale_min(const uint8_t* s, int64_t j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// ---- portable path: one 32-element chunk into floats ------------------------------------
// Chunk c of a row is elements [32c, 32c + 32). Each type's arithmetic mirrors gguf-py's.

void chunk_scalar(int64_t t, const uint8_t* row, int64_t c, float* y) {
  switch (t) {
    case Q8_0: {
      const uint8_t* b = row + c * 34;
      const float d = half_to_float(b);
      for (int i = 0; i < 32; ++i) y[i] = static_cast<float>(static_cast<int8_t>(b[2 + i])) * d;
      return;
    }
    case Q4_0: {
      const uint8_t* b = row + c * 18;
      const float d = half_to_float(b);
      for (int i = 0; i < 16; ++i) {
        y[i] = d * static_cast<float>((b[2 + i] & 0xF) - 8);
        y[i + 16] = d * static_cast<float>((b[2 + i] >> 4) - 8);
      }
      return;
    }
    case Q4_1: {
      const uint8_t* b = row + c * 20;
      const float d = half_to_float(b), m = half_to_float(b + 2);
      for (int i = 0; i < 16; ++i) {
        y[i] = d * static_cast<float>(b[4 + i] & 0xF) + m;
        y[i + 16] = d * static_cast<float>(b[4 + i] >> 4) + m;
      }
      return;
    }
    case Q4_K: {
      const uint8_t* b = row + (c / 8) * 144;
      const int64_t j = c % 8;
      int sc, mn;
      q4k_scale_min(b + 4, j, sc, mn);
      const float d = half_to_float(b) * static_cast<float>(sc);
      const float dm = half_to_float(b + 2) * static_cast<float>(mn);
      const uint8_t* q = b + 16 + (j / 2) * 32;
      const int shift = (j % 2) * 4;
      for (int i = 0; i < 32; ++i) y[i] = d * static_cast<float>((q[i] >> shift) & 0xF) - dm;
      return;
    }
    case Q6_K: {
      const uint8_t* b = row + (c / 8) * 210;
      const int64_t j = c % 8, h = j / 4, t4 = j % 4;
      const uint8_t* ql = b + 64 * h + (t4 % 2) * 32;
      const uint8_t* qh = b + 128 + 32 * h;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * h + 2 * t4;
      const float d = half_to_float(b + 208);
      const int lshift = (t4 / 2) * 4, hshift = 2 * t4;
      for (int half = 0; half < 2; ++half) {
        const float ds = d * static_cast<float>(sc[half]);
        for (int i = 16 * half; i < 16 * half + 16; ++i) {
          const int q = (((ql[i] >> lshift) & 0xF) | (((qh[i] >> hshift) & 3) << 4)) - 32;
          y[i] = ds * static_cast<float>(q);
        }
      }
      return;
    }
    default: TORCH_CHECK(false, "quantization type ", t, " has no kernel");
  }
}

void row_dot_scalar(int64_t t, const uint8_t* row, int64_t K, const float* x, int64_t M,
                    int64_t ldx, float* out, int64_t ldo) {
  float w[32];
  for (int64_t m0 = 0; m0 < M; m0 += MR) {
    const int64_t mr = std::min(MR, M - m0);
    float acc[MR] = {};
    for (int64_t c = 0; c < K / 32; ++c) {
      chunk_scalar(t, row, c, w);
      for (int64_t r = 0; r < mr; ++r) {
        const float* xr = x + (m0 + r) * ldx + 32 * c;
        float s = 0.f;
        for (int i = 0; i < 32; ++i) s += w[i] * xr[i];
        acc[r] += s;
      }
    }
    for (int64_t r = 0; r < mr; ++r) out[(m0 + r) * ldo] = acc[r];
  }
}

#ifdef PDSERVE_AVX2
// ---- AVX2 path: one 32-element chunk into four vectors of 8 --------------------------------

inline float half_f16c(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m256 bcast_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<int16_t>(h)));
}

inline __m256i load8_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i load8_i8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

template <int64_t t>
inline void chunk_avx2(const uint8_t* row, int64_t c, __m256 w[4]) {
  const __m256i lo4 = _mm256_set1_epi32(0xF);
  switch (t) {
    case Q8_0: {
      const uint8_t* b = row + c * 34;
      const __m256 d = bcast_half(b);
      for (int v = 0; v < 4; ++v)
        w[v] = _mm256_mul_ps(_mm256_cvtepi32_ps(load8_i8(b + 2 + 8 * v)), d);
      return;
    }
    case Q4_0: {
      const uint8_t* b = row + c * 18;
      const __m256 d = bcast_half(b);
      const __m256i eight = _mm256_set1_epi32(8);
      for (int v = 0; v < 2; ++v) {
        const __m256i q = load8_u8(b + 2 + 8 * v);
        const __m256i lo = _mm256_sub_epi32(_mm256_and_si256(q, lo4), eight);
        const __m256i hi = _mm256_sub_epi32(_mm256_srli_epi32(q, 4), eight);
        w[v] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(lo));
        w[v + 2] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(hi));
      }
      return;
    }
    case Q4_1: {
      const uint8_t* b = row + c * 20;
      const __m256 d = bcast_half(b), m = bcast_half(b + 2);
      for (int v = 0; v < 2; ++v) {
        const __m256i q = load8_u8(b + 4 + 8 * v);
        w[v] = _mm256_add_ps(
            _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(q, lo4))), m);
        w[v + 2] = _mm256_add_ps(
            _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4))), m);
      }
      return;
    }
    case Q4_K: {
      const uint8_t* b = row + (c / 8) * 144;
      const int64_t j = c % 8;
      int sc, mn;
      q4k_scale_min(b + 4, j, sc, mn);
      const __m256 d = _mm256_set1_ps(half_f16c(b) * static_cast<float>(sc));
      const __m256 dm = _mm256_set1_ps(half_f16c(b + 2) * static_cast<float>(mn));
      const uint8_t* q = b + 16 + (j / 2) * 32;
      const int shift = static_cast<int>(j % 2) * 4;
      const __m128i sh = _mm_cvtsi32_si128(shift);
      for (int v = 0; v < 4; ++v) {
        const __m256i qi = _mm256_and_si256(_mm256_srl_epi32(load8_u8(q + 8 * v), sh), lo4);
        w[v] = _mm256_sub_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(qi)), dm);
      }
      return;
    }
    case Q6_K: {
      const uint8_t* b = row + (c / 8) * 210;
      const int64_t j = c % 8, h = j / 4, t4 = j % 4;
      const uint8_t* ql = b + 64 * h + (t4 % 2) * 32;
      const uint8_t* qh = b + 128 + 32 * h;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * h + 2 * t4;
      const float d = half_f16c(b + 208);
      const __m128i ls = _mm_cvtsi32_si128(static_cast<int>(t4 / 2) * 4);
      const __m128i hs = _mm_cvtsi32_si128(static_cast<int>(2 * t4));
      const __m256i three = _mm256_set1_epi32(3), bias = _mm256_set1_epi32(32);
      for (int v = 0; v < 4; ++v) {
        const __m256 ds = _mm256_set1_ps(d * static_cast<float>(sc[v / 2]));
        const __m256i lo = _mm256_and_si256(_mm256_srl_epi32(load8_u8(ql + 8 * v), ls), lo4);
        const __m256i hi = _mm256_and_si256(_mm256_srl_epi32(load8_u8(qh + 8 * v), hs), three);
        const __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), bias);
        w[v] = _mm256_mul_ps(ds, _mm256_cvtepi32_ps(q));
      }
      return;
    }
    default: TORCH_CHECK(false, "quantization type ", t, " has no kernel");
  }
}

// Types whose 32-element chunk has one scale d and one offset m (w = d * q + m): their
// products take d and m out of the sum, sum(x w) = d sum(x q) + m sum(x), which saves two
// operations per 8 weights. (Q6_K has a scale per 16 elements and keeps the dequantized
// vectors.) Only the order of float32 operations differs from dequantize-then-multiply.
template <int64_t t>
constexpr bool kFactored = t == Q8_0 || t == Q4_0 || t == Q4_1 || t == Q4_K;
template <int64_t t>
constexpr bool kHasMin = t == Q4_1 || t == Q4_K;

template <int64_t t>
inline void chunk_q(const uint8_t* row, int64_t c, __m256 q[4], float& d, float& m) {
  const __m256i lo4 = _mm256_set1_epi32(0xF);
  if constexpr (t == Q8_0) {
    const uint8_t* b = row + c * 34;
    d = half_f16c(b);
    m = 0.f;
    for (int v = 0; v < 4; ++v) q[v] = _mm256_cvtepi32_ps(load8_i8(b + 2 + 8 * v));
  } else if constexpr (t == Q4_0 || t == Q4_1) {
    const int64_t size = t == Q4_0 ? 18 : 20, off = t == Q4_0 ? 2 : 4;
    const uint8_t* b = row + c * size;
    d = half_f16c(b);
    m = t == Q4_1 ? half_f16c(b + 2) : 0.f;
    const __m256i bias = _mm256_set1_epi32(t == Q4_0 ? 8 : 0);
    for (int v = 0; v < 2; ++v) {
      const __m256i qi = load8_u8(b + off + 8 * v);
      q[v] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(qi, lo4), bias));
      q[v + 2] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(qi, 4), bias));
    }
  } else if constexpr (t == Q4_K) {
    const uint8_t* b = row + (c / 8) * 144;
    const int64_t j = c % 8;
    int sc, mn;
    q4k_scale_min(b + 4, j, sc, mn);
    d = half_f16c(b) * static_cast<float>(sc);
    m = -(half_f16c(b + 2) * static_cast<float>(mn));
    const uint8_t* qs = b + 16 + (j / 2) * 32;
    const __m128i sh = _mm_cvtsi32_si128(static_cast<int>(j % 2) * 4);
    for (int v = 0; v < 4; ++v)
      q[v] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(load8_u8(qs + 8 * v), sh), lo4));
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows [m0, m0 + R) of x against one row of W: each dequantized chunk feeds R rows.
template <int64_t t, int R>
inline void row_dot_avx2(const uint8_t* row, int64_t K, const float* x, int64_t ldx,
                         const float* xsum, float* out, int64_t ldo) {
  __m256 acc[R];
  float macc[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    macc[r] = 0.f;
  }
  __m256 w[4];
  const int64_t chunks = K / 32;
  // Weights stream from memory once per call: ask for the bytes PREFETCH ahead (past this
  // row's end that is the next row's start) so the loads overlap the arithmetic.
  constexpr int64_t chunk_bytes = layout_of(t).bytes * 32 / layout_of(t).elems;
  for (int64_t c = 0; c < chunks; ++c) {
    _mm_prefetch(reinterpret_cast<const char*>(row + c * chunk_bytes + PREFETCH), _MM_HINT_T0);
    if constexpr (kFactored<t>) {
      float d, m;
      chunk_q<t>(row, c, w, d, m);
      const __m256 dv = _mm256_set1_ps(d);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * ldx + 32 * c;
        __m256 a = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));
        a = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), a);
        a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), a);
        a = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), a);
        acc[r] = _mm256_fmadd_ps(dv, a, acc[r]);
        if constexpr (kHasMin<t>) macc[r] += m * xsum[r * chunks + c];
      }
    } else {
      chunk_avx2<t>(row, c, w);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * ldx + 32 * c;
        __m256 a = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));
        a = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), a);
        a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), a);
        a = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), a);
        acc[r] = _mm256_add_ps(acc[r], a);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = hsum(acc[r]) + macc[r];
}

template <int64_t t>
void row_dot_avx2_any(const uint8_t* row, int64_t K, const float* x, int64_t M, int64_t ldx,
                      const float* xsum, float* out, int64_t ldo) {
  const int64_t chunks = K / 32;
  int64_t m0 = 0;
  for (; m0 + MR <= M; m0 += MR)
    row_dot_avx2<t, MR>(row, K, x + m0 * ldx, ldx, xsum + m0 * chunks, out + m0 * ldo, ldo);
  x += m0 * ldx;
  xsum += m0 * chunks;
  out += m0 * ldo;
  switch (M - m0) {
    case 7: row_dot_avx2<t, 7>(row, K, x, ldx, xsum, out, ldo); break;
    case 6: row_dot_avx2<t, 6>(row, K, x, ldx, xsum, out, ldo); break;
    case 5: row_dot_avx2<t, 5>(row, K, x, ldx, xsum, out, ldo); break;
    case 4: row_dot_avx2<t, 4>(row, K, x, ldx, xsum, out, ldo); break;
    case 3: row_dot_avx2<t, 3>(row, K, x, ldx, xsum, out, ldo); break;
    case 2: row_dot_avx2<t, 2>(row, K, x, ldx, xsum, out, ldo); break;
    case 1: row_dot_avx2<t, 1>(row, K, x, ldx, xsum, out, ldo); break;
    default: break;
  }
}

template <int64_t t>
void qlinear_avx2(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const float* x,
                  int64_t M, float* out) {
  // Each 32-element chunk's sum of x, for the offsets of types with a min.
  const int64_t chunks = K / 32;
  std::vector<float> xsum(kHasMin<t> ? M * chunks : 0);
  if constexpr (kHasMin<t>) {
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < chunks; ++c) {
        const float* xc = x + r * K + 32 * c;
        __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xc), _mm256_loadu_ps(xc + 8)),
                                 _mm256_add_ps(_mm256_loadu_ps(xc + 16), _mm256_loadu_ps(xc + 24)));
        xsum[r * chunks + c] = hsum(s);
      }
  }
  const float* xs = xsum.data();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      row_dot_avx2_any<t>(w + n * row_bytes, K, x, M, K, xs, out + n, N);
  });
}

#ifdef PDSERVE_AVX512
inline __m512i load16_u8(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m512i load16_i8(const uint8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m512 bcast_half16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<int16_t>(h)));
}

// One 32-element chunk of a one-scale type into two vectors of 16: half the instructions
// of chunk_avx2, the same float32 operations on each element (bit-identical values).
template <int64_t t>
inline void chunk_avx512(const uint8_t* row, int64_t c, __m512 w[2]) {
  const __m512i lo4 = _mm512_set1_epi32(0xF);
  if constexpr (t == Q8_0) {
    const uint8_t* b = row + c * 34;
    const __m512 d = bcast_half16(b);
    w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(load16_i8(b + 2)), d);
    w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(load16_i8(b + 18)), d);
  } else if constexpr (t == Q4_0) {
    const uint8_t* b = row + c * 18;
    const __m512 d = bcast_half16(b);
    const __m512i q = load16_u8(b + 2), eight = _mm512_set1_epi32(8);
    w[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(q, lo4), eight)));
    w[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(q, 4), eight)));
  } else {
    static_assert(t == Q4_1, "chunk_avx512 covers Q8_0, Q4_0 and Q4_1");
    const uint8_t* b = row + c * 20;
    const __m512 d = bcast_half16(b), m = bcast_half16(b + 2);
    const __m512i q = load16_u8(b + 4);
    w[0] = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(q, lo4))), m);
    w[1] = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4))), m);
  }
}
#endif

template <int64_t t>
inline void dequantize_row_avx2(const uint8_t* row, int64_t K, float* out) {
#ifdef PDSERVE_AVX512
  if constexpr (t == Q8_0 || t == Q4_0 || t == Q4_1) {
    __m512 v[2];
    for (int64_t c = 0; c < K / 32; ++c) {
      chunk_avx512<t>(row, c, v);
      _mm512_storeu_ps(out + 32 * c, v[0]);
      _mm512_storeu_ps(out + 32 * c + 16, v[1]);
    }
    return;
  }
#endif
  __m256 v[4];
  for (int64_t c = 0; c < K / 32; ++c) {
    chunk_avx2<t>(row, c, v);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 32 * c + 8 * i, v[i]);
  }
}

template <int64_t t>
void dequantize_avx2(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, float* out) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) dequantize_row_avx2<t>(w + n * row_bytes, K, out + n * K);
  });
}

// ---- tiled path: larger batches -------------------------------------------------------
// TW rows of W are dequantized into a float32 tile (in L1: TW * K * 4 bytes) and every
// input row of the panel runs against it in passes of up to TX rows: TX x TW accumulators
// of L lanes, one pass over K. Per L columns of k: TX loads of x, TW of the tile, TX * TW
// FMAs. A product (m, n) is the sum over its L lanes of a running FMA over k, the same
// operations whatever the batch holds, however it is cut into passes and however many
// threads run it.
//
// L and TX are what the vector registers hold: AVX2's 16 registers of 8 lanes fit 3 x 4
// accumulators, the 3 rows of x and a tile value; AVX-512's 32 registers of 16 lanes fit
// 6 x 4 + 6 + 1. (The tile is dequantized 16 wide there too: per weight, the unpacking
// costs as much as the FMAs of a 6-row pass.) A pass of 1 or 2 rows has too few independent
// sums to keep both FMA units busy (~55-60% of the 3-row pass's speed), so a panel's rows
// are spread evenly over the fewest passes: 8 rows run as 4 + 4, not 3 + 3 + 2
// (docs/benchmarks.md).
constexpr int64_t TW = 4;   // weight rows per tile
#ifdef PDSERVE_AVX512
constexpr int64_t TX = 6;   // input rows in registers
#else
constexpr int64_t TX = 3;
#endif
constexpr int64_t TM = 64;  // input rows per panel: the panel of x stays in L2

// The 4 horizontal sums of a0..a3 (lane j = sum of aj).
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// The vector of the passes: 16 lanes where AVX-512 is built, else 8. fold() leaves the 8
// sums the AVX2 kernel's lanes would hold (lanes i and i + 8 added), for hsum4.
#ifdef PDSERVE_AVX512
struct TileVec {
  using T = __m512;
  static constexpr int64_t lanes = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static __m256 fold(T a) {
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    return _mm256_add_ps(_mm512_castps512_ps256(a), hi);
  }
};
#else
struct TileVec {
  using T = __m256;
  static constexpr int64_t lanes = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static __m256 fold(T a) { return a; }
};
#endif

template <int R>
inline void tile_dot(const float* tile, int64_t K, const float* x, float res[TX][TW]) {
  static_assert(TW == 4, "a row's TW sums are one hsum4");
  static_assert(R <= TX, "a pass holds at most TX rows");
  using V = TileVec;
  V::T acc[R][TW];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < TW; ++j) acc[r][j] = V::zero();
  for (int64_t k = 0; k < K; k += V::lanes) {  // K is a multiple of 32 (the block size)
    V::T xv[R];
    for (int r = 0; r < R; ++r) xv[r] = V::load(x + r * K + k);
    for (int j = 0; j < TW; ++j) {
      const V::T wv = V::load(tile + j * K + k);
      for (int r = 0; r < R; ++r) acc[r][j] = V::fma(wv, xv[r], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    _mm_storeu_ps(res[r], hsum4(V::fold(acc[r][0]), V::fold(acc[r][1]), V::fold(acc[r][2]),
                                V::fold(acc[r][3])));
}

// One pass of `rows` (1..TX) rows of x against the tile.
inline void tile_pass(int64_t rows, const float* tile, int64_t K, const float* x,
                      float res[TX][TW]) {
  switch (rows) {
#ifdef PDSERVE_AVX512
    case 6: tile_dot<6>(tile, K, x, res); break;
    case 5: tile_dot<5>(tile, K, x, res); break;
    case 4: tile_dot<4>(tile, K, x, res); break;
#endif
    case 3: tile_dot<3>(tile, K, x, res); break;
    case 2: tile_dot<2>(tile, K, x, res); break;
    default: tile_dot<1>(tile, K, x, res); break;
  }
}

template <int64_t t>
void qlinear_tiled_avx2(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K,
                        const float* x, int64_t M, float* out) {
  const int64_t tiles = (N + TW - 1) / TW;
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(TW * K, 0.f);  // rows past N stay zero
    float res[TX][TW];
    for (int64_t m0 = 0; m0 < M; m0 += TM) {
      const int64_t rows = std::min(M, m0 + TM) - m0, passes = (rows + TX - 1) / TX;
      for (int64_t b = begin; b < end; ++b) {
        const int64_t n0 = b * TW, nw = std::min(TW, N - n0);
        for (int64_t j = 0; j < nw; ++j)
          dequantize_row_avx2<t>(w + (n0 + j) * row_bytes, K, tile.data() + j * K);
        for (int64_t p = 0, m = m0; p < passes; ++p) {
          const int64_t r_p = rows / passes + (p < rows % passes ? 1 : 0);  // differ by <= 1
          tile_pass(r_p, tile.data(), K, x + m * K, res);
          for (int64_t r = 0; r < r_p; ++r)
            for (int64_t j = 0; j < nw; ++j) out[(m + r) * N + n0 + j] = res[r][j];
          m += r_p;
        }
      }
    }
  });
}

// Calls f.template operator()<T>() for the runtime type id.
template <typename F>
void dispatch(int64_t t, F&& f) {
  switch (t) {
    case Q4_0: f(std::integral_constant<int64_t, Q4_0>{}); break;
    case Q4_1: f(std::integral_constant<int64_t, Q4_1>{}); break;
    case Q8_0: f(std::integral_constant<int64_t, Q8_0>{}); break;
    case Q4_K: f(std::integral_constant<int64_t, Q4_K>{}); break;
    case Q6_K: f(std::integral_constant<int64_t, Q6_K>{}); break;
    default: TORCH_CHECK(false, "quantization type ", t, " has no kernel");
  }
}
#endif

}  // namespace

// kernel: 0 the fused kernel, 1 the tiled one, 2 the portable path (which every kernel is
// on a build without AVX2).
void qlinear(torch::Tensor out, torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t kernel) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const Layout l = layout_of(qtype);
  TORCH_CHECK(l.elems > 0, "quantization type ", qtype, " has no kernel");
  TORCH_CHECK(K % l.elems == 0 && w.size(1) == K / l.elems * l.bytes, "qlinear: bad shapes");
  TORCH_CHECK(0 <= kernel && kernel <= 2, "qlinear: kernel is 0, 1 or 2, got ", kernel);
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = w.size(1);
#ifdef PDSERVE_AVX2
  if (kernel == 0) {
    dispatch(qtype, [&](auto t) { qlinear_avx2<decltype(t)::value>(wp, row_bytes, N, K, xp, M, op); });
    return;
  }
  if (kernel == 1) {
    dispatch(qtype, [&](auto t) { qlinear_tiled_avx2<decltype(t)::value>(wp, row_bytes, N, K, xp, M, op); });
    return;
  }
#endif
  // One work item is one output column; a thread takes a contiguous run of them.
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      row_dot_scalar(qtype, wp + n * row_bytes, K, xp, M, K, op + n, N);
  });
}

void dequantize(torch::Tensor out, torch::Tensor w, int64_t qtype, bool portable) {
  const int64_t N = w.size(0), K = out.size(1);
  const Layout l = layout_of(qtype);
  TORCH_CHECK(l.elems > 0, "quantization type ", qtype, " has no kernel");
  TORCH_CHECK(K % l.elems == 0 && w.size(1) == K / l.elems * l.bytes, "dequantize: bad shapes");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = w.size(1);
#ifdef PDSERVE_AVX2
  if (!portable) {
    dispatch(qtype, [&](auto t) { dequantize_avx2<decltype(t)::value>(wp, row_bytes, N, K, op); });
    return;
  }
#endif
  (void)portable;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t c = 0; c < K / 32; ++c) chunk_scalar(qtype, wp + n * row_bytes, c, op + n * K + 32 * c);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qlinear", &qlinear, "out = x @ W^T for a GGUF-quantized W (float32 x, CPU)");
  m.def("dequantize", &dequantize, "rows of a GGUF-quantized W as float32 (CPU)");
}
