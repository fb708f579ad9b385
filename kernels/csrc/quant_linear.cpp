// Linear layers over GGUF-quantized weights kept as their packed blocks, for CPUs.
//
//   qlinear(out, x, w):  out[m, n] = sum_k x[m, k] * W[n, k]
//   dequantize(out, w):  out[n, k] = W[n, k]
//
// W is the checkpoint's bytes as stored: row n is K / block_elems blocks of llama.cpp's
// layout (Q8_0, Q4_0, Q4_1: 32 elements per block; Q4_K, Q6_K: 256 per super-block).
//
// dequantize: a weight is dequantized 8 elements at a time in registers, with the same
// float32 operations in the same order as gguf-py's numpy reference, so a dequantized
// element is bit-identical to the float32 checkpoint's.
//
// qlinear multiplies in integers. Every 32-element chunk of a row of x is rounded to 16-bit
// integers on its own scale (s = max|x| / 32767, xq = round(x / s)), and each weight chunk
// is its integer codes q with float scales: w = d q + m (Q6_K: a d per 16 elements). So
//
//   sum(x w) ~= s d sum(xq q) + m sum(x),
//
// where sum(xq q) is exact in int32 (two 16-bit products per instruction) and sum(x) is the
// float32 sum of the chunk. The only error against float32 is the rounding of x: at most
// s / 2 per element, i.e. 1.5e-5 of the chunk's largest |x| (llama.cpp rounds x to 8 bits,
// 256x coarser). What it buys: half the instructions of dequantizing into float32 vectors.
//
// Work is split over output columns (rows of W): each weight byte is read once per call,
// whatever M is. Up to MR input rows share each unpacked weight chunk, so batches of 2..64
// pay for unpacking once per MR (8) rows. Chunks are taken in pairs, each pair's two terms
// summed before they join the row's accumulator: the same order for every row count, so a
// row's output does not depend on the batch it is in.
//
// Shapes and dtypes are checked by the Python launcher (kernels/quant_linear.py):
//   x   [M, K]                 float32, contiguous
//   w   [N, K / be * bytes]    uint8,   contiguous
//   out [M, N] or [N, K]       float32, contiguous
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PDSERVE_AVX2 1
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

// ---- activations: each 32-element chunk as 16-bit integers on its own scale ------------

// A chunk whose largest |x| is below this is taken as zero: 32767 / amax would overflow.
constexpr float kTinyChunk = 1e-30f;

struct Activations {
  int64_t chunks;               // per row: K / 32
  std::vector<int16_t> q;       // [M, K]
  std::vector<float> scale;     // [M, chunks]: s, x ~= s * q
  std::vector<float> sum;       // [M, chunks]: sum of the chunk's x (float32, in order)
};

void quantize_chunk_scalar(const float* x, int16_t* q, float& scale, float& sum) {
  float amax = 0.f, s = 0.f;
  for (int i = 0; i < 32; ++i) {
    amax = std::max(amax, std::fabs(x[i]));
    s += x[i];
  }
  const float inv = amax >= kTinyChunk ? 32767.f / amax : 0.f;
  for (int i = 0; i < 32; ++i) q[i] = static_cast<int16_t>(std::nearbyint(x[i] * inv));
  scale = amax >= kTinyChunk ? amax / 32767.f : 0.f;
  sum = s;
}

// ---- portable path: one 32-element weight chunk as integer codes ----------------------------
// Chunk c of a row: codes q[32] with w = d[i / 16] * q + m. Mirrors chunk_scalar's decoding.

struct IntChunk {
  int16_t q[32];
  float d[2];  // scale of elements 0..15 and 16..31
  float m;     // offset (0 for types without one)
};

void int_chunk_scalar(int64_t t, const uint8_t* row, int64_t c, IntChunk& k) {
  k.m = 0.f;
  switch (t) {
    case Q8_0: {
      const uint8_t* b = row + c * 34;
      k.d[0] = k.d[1] = half_to_float(b);
      for (int i = 0; i < 32; ++i) k.q[i] = static_cast<int8_t>(b[2 + i]);
      return;
    }
    case Q4_0:
    case Q4_1: {
      const bool min = t == Q4_1;
      const uint8_t* b = row + c * (min ? 20 : 18);
      k.d[0] = k.d[1] = half_to_float(b);
      const uint8_t* qs = b + (min ? 4 : 2);
      if (min) k.m = half_to_float(b + 2);
      const int bias = min ? 0 : 8;
      for (int i = 0; i < 16; ++i) {
        k.q[i] = static_cast<int16_t>((qs[i] & 0xF) - bias);
        k.q[i + 16] = static_cast<int16_t>((qs[i] >> 4) - bias);
      }
      return;
    }
    case Q4_K: {
      const uint8_t* b = row + (c / 8) * 144;
      const int64_t j = c % 8;
      int sc, mn;
      q4k_scale_min(b + 4, j, sc, mn);
      k.d[0] = k.d[1] = half_to_float(b) * static_cast<float>(sc);
      k.m = -(half_to_float(b + 2) * static_cast<float>(mn));
      const uint8_t* q = b + 16 + (j / 2) * 32;
      const int shift = (j % 2) * 4;
      for (int i = 0; i < 32; ++i) k.q[i] = static_cast<int16_t>((q[i] >> shift) & 0xF);
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
      k.d[0] = d * static_cast<float>(sc[0]);
      k.d[1] = d * static_cast<float>(sc[1]);
      for (int i = 0; i < 32; ++i)
        k.q[i] = static_cast<int16_t>((((ql[i] >> lshift) & 0xF) | (((qh[i] >> hshift) & 3) << 4)) - 32);
      return;
    }
    default: TORCH_CHECK(false, "quantization type ", t, " has no kernel");
  }
}

// One chunk's term for one row: s (d0 sum(xq q)[0:16] + d1 sum(xq q)[16:32]) + m sum(x).
inline float chunk_term(const IntChunk& k, const int16_t* xq, float s, float xsum) {
  int32_t lo = 0, hi = 0;
  for (int i = 0; i < 16; ++i) lo += static_cast<int32_t>(k.q[i]) * xq[i];
  for (int i = 16; i < 32; ++i) hi += static_cast<int32_t>(k.q[i]) * xq[i];
  return s * (k.d[0] * static_cast<float>(lo) + k.d[1] * static_cast<float>(hi)) + k.m * xsum;
}

void row_dot_scalar(int64_t t, const uint8_t* row, int64_t K, const Activations& a, int64_t M,
                    float* out, int64_t ldo) {
  const int64_t chunks = K / 32;
  IntChunk k;
  for (int64_t m0 = 0; m0 < M; m0 += MR) {
    const int64_t mr = std::min(MR, M - m0);
    float acc[MR] = {};
    for (int64_t c = 0; c < chunks; ++c) {
      int_chunk_scalar(t, row, c, k);
      for (int64_t r = m0; r < m0 + mr; ++r) {
        const int64_t rc = r * chunks + c;
        acc[r - m0] += chunk_term(k, a.q.data() + r * K + 32 * c, a.scale[rc], a.sum[rc]);
      }
    }
    for (int64_t r = 0; r < mr; ++r) out[(m0 + r) * ldo] = acc[r];
  }
}

#ifdef PDSERVE_AVX2
// ---- AVX2 dequantization: one 32-element chunk into four vectors of 8 -------------------

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

// ---- AVX2 products: integer chunks --------------------------------------------------------

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline void quantize_chunk_avx2(const float* x, int16_t* q, float& scale, float& sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
  }
  sum = hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const __m256 inv = _mm256_set1_ps(amax >= kTinyChunk ? 32767.f / amax : 0.f);
  scale = amax >= kTinyChunk ? amax / 32767.f : 0.f;
  __m256i r[4];
  for (int i = 0; i < 4; ++i) r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  // packs interleaves 128-bit lanes; the permute puts the 16 values back in order.
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permute4x64_epi64(_mm256_packs_epi32(r[0], r[1]), 0xD8));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16),
                      _mm256_permute4x64_epi64(_mm256_packs_epi32(r[2], r[3]), 0xD8));
}

// One weight chunk: codes of elements 0..15 (lo) and 16..31 (hi) as int16, w = d q + m.
struct WChunk {
  __m256i lo, hi;
  float d0, d1, m;  // d0 == d1 except for Q6_K
};

template <int64_t t>
constexpr bool kHasMin = t == Q4_1 || t == Q4_K;
template <int64_t t>
constexpr bool kOneScale = t != Q6_K;  // one d for the whole chunk

inline __m128i load16(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

template <int64_t t>
inline WChunk int_chunk_avx2(const uint8_t* row, int64_t c) {
  const __m128i lo4 = _mm_set1_epi8(0xF);
  WChunk k;
  k.m = 0.f;
  if constexpr (t == Q8_0) {
    const uint8_t* b = row + c * 34;
    k.d0 = k.d1 = half_f16c(b);
    k.lo = _mm256_cvtepi8_epi16(load16(b + 2));
    k.hi = _mm256_cvtepi8_epi16(load16(b + 18));
  } else if constexpr (t == Q4_0 || t == Q4_1) {
    const uint8_t* b = row + c * (t == Q4_1 ? 20 : 18);
    uint32_t dm;
    std::memcpy(&dm, b, 4);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm)));
    k.d0 = k.d1 = _mm_cvtss_f32(f);
    const __m128i qs = load16(b + (t == Q4_1 ? 4 : 2));
    __m128i lo = _mm_and_si128(qs, lo4), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), lo4);
    if constexpr (t == Q4_1) {
      k.m = _mm_cvtss_f32(_mm_movehdup_ps(f));
      k.lo = _mm256_cvtepu8_epi16(lo);
      k.hi = _mm256_cvtepu8_epi16(hi);
    } else {
      const __m128i eight = _mm_set1_epi8(8);
      k.lo = _mm256_cvtepi8_epi16(_mm_sub_epi8(lo, eight));
      k.hi = _mm256_cvtepi8_epi16(_mm_sub_epi8(hi, eight));
    }
  } else if constexpr (t == Q4_K) {
    const uint8_t* b = row + (c / 8) * 144;
    const int64_t j = c % 8;
    int sc, mn;
    q4k_scale_min(b + 4, j, sc, mn);
    k.d0 = k.d1 = half_f16c(b) * static_cast<float>(sc);
    k.m = -(half_f16c(b + 2) * static_cast<float>(mn));
    const uint8_t* qs = b + 16 + (j / 2) * 32;
    const __m128i sh = _mm_cvtsi32_si128(static_cast<int>(j % 2) * 4);
    k.lo = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srl_epi16(load16(qs), sh), lo4));
    k.hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srl_epi16(load16(qs + 16), sh), lo4));
  } else if constexpr (t == Q6_K) {
    const uint8_t* b = row + (c / 8) * 210;
    const int64_t j = c % 8, h = j / 4, t4 = j % 4;
    const uint8_t* ql = b + 64 * h + (t4 % 2) * 32;
    const uint8_t* qh = b + 128 + 32 * h;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * h + 2 * t4;
    const float d = half_f16c(b + 208);
    k.d0 = d * static_cast<float>(sc[0]);
    k.d1 = d * static_cast<float>(sc[1]);
    const __m128i ls = _mm_cvtsi32_si128(static_cast<int>(t4 / 2) * 4);
    const __m128i hs = _mm_cvtsi32_si128(static_cast<int>(2 * t4));
    const __m128i three = _mm_set1_epi8(3), bias = _mm_set1_epi8(32);
    __m128i q[2];
    for (int v = 0; v < 2; ++v) {
      const __m128i l = _mm_and_si128(_mm_srl_epi16(load16(ql + 16 * v), ls), lo4);
      const __m128i u = _mm_and_si128(_mm_srl_epi16(load16(qh + 16 * v), hs), three);
      q[v] = _mm_sub_epi8(_mm_or_si128(l, _mm_slli_epi16(u, 4)), bias);
    }
    k.lo = _mm256_cvtepi8_epi16(q[0]);
    k.hi = _mm256_cvtepi8_epi16(q[1]);
  }
  return k;
}

inline __m256i madd16(__m256i w, const int16_t* x) {
  return _mm256_madd_epi16(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

// s d sum(xq q) of one chunk for one row, as 8 lanes; `add` joins it with fma where it can.
template <int64_t t>
inline __m256 chunk_term_avx2(const WChunk& k, const int16_t* xq, float s, __m256 add) {
  if constexpr (kOneScale<t>) {
    const __m256i p = _mm256_add_epi32(madd16(k.lo, xq), madd16(k.hi, xq + 16));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(s * k.d0), add);
  } else {
    const __m256 hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(madd16(k.hi, xq + 16)),
                                      _mm256_set1_ps(s * k.d1), add);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(madd16(k.lo, xq)), _mm256_set1_ps(s * k.d0), hi);
  }
}

// Rows [0, R) of the activations against one row of W: each unpacked chunk feeds R rows.
// q, scale and sum point at the first of the R rows (row strides K and chunks).
template <int64_t t, int R>
inline void row_dot_avx2(const uint8_t* row, int64_t K, const int16_t* q, const float* scale,
                         const float* sum, float* out, int64_t ldo) {
  const int64_t chunks = K / 32;
  __m256 acc[R];
  float macc[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    macc[r] = 0.f;
  }
  // Weights stream from memory once per call: ask for the bytes PREFETCH ahead (past this
  // row's end that is the next row's start) so the loads overlap the arithmetic.
  constexpr int64_t chunk_bytes = layout_of(t).bytes * 32 / layout_of(t).elems;
  const __m256 zero = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 2 <= chunks; c += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(row + c * chunk_bytes + PREFETCH), _MM_HINT_T0);
    const WChunk k0 = int_chunk_avx2<t>(row, c), k1 = int_chunk_avx2<t>(row, c + 1);
    for (int r = 0; r < R; ++r) {
      const int16_t* xr = q + r * K + 32 * c;
      const float* sr = scale + r * chunks + c;
      const __m256 pair = chunk_term_avx2<t>(k0, xr, sr[0], chunk_term_avx2<t>(k1, xr + 32, sr[1], zero));
      acc[r] = _mm256_add_ps(acc[r], pair);
      if constexpr (kHasMin<t>) {
        const float* xs = sum + r * chunks + c;
        macc[r] += k0.m * xs[0] + k1.m * xs[1];
      }
    }
  }
  if (c < chunks) {  // an odd chunk count: the last one alone
    const WChunk k0 = int_chunk_avx2<t>(row, c);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_add_ps(acc[r], chunk_term_avx2<t>(k0, q + r * K + 32 * c, scale[r * chunks + c], zero));
      if constexpr (kHasMin<t>) macc[r] += k0.m * sum[r * chunks + c];
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = hsum(acc[r]) + macc[r];
}

template <int64_t t>
void row_dot_avx2_any(const uint8_t* row, int64_t K, const Activations& a, int64_t M, float* out,
                      int64_t ldo) {
  const int64_t chunks = K / 32;
  const int16_t* q = a.q.data();
  const float* scale = a.scale.data();
  const float* sum = a.sum.data();
  int64_t m0 = 0;
  for (; m0 + MR <= M; m0 += MR)
    row_dot_avx2<t, MR>(row, K, q + m0 * K, scale + m0 * chunks, sum + m0 * chunks,
                        out + m0 * ldo, ldo);
  q += m0 * K;
  scale += m0 * chunks;
  sum += m0 * chunks;
  out += m0 * ldo;
  switch (M - m0) {
    case 7: row_dot_avx2<t, 7>(row, K, q, scale, sum, out, ldo); break;
    case 6: row_dot_avx2<t, 6>(row, K, q, scale, sum, out, ldo); break;
    case 5: row_dot_avx2<t, 5>(row, K, q, scale, sum, out, ldo); break;
    case 4: row_dot_avx2<t, 4>(row, K, q, scale, sum, out, ldo); break;
    case 3: row_dot_avx2<t, 3>(row, K, q, scale, sum, out, ldo); break;
    case 2: row_dot_avx2<t, 2>(row, K, q, scale, sum, out, ldo); break;
    case 1: row_dot_avx2<t, 1>(row, K, q, scale, sum, out, ldo); break;
    default: break;
  }
}

template <int64_t t>
void qlinear_avx2(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K,
                  const Activations& a, int64_t M, float* out) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      row_dot_avx2_any<t>(w + n * row_bytes, K, a, M, out + n, N);
  });
}

template <int64_t t>
void dequantize_avx2(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, float* out) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      __m256 v[4];
      for (int64_t c = 0; c < K / 32; ++c) {
        chunk_avx2<t>(w + n * row_bytes, c, v);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + n * K + 32 * c + 8 * i, v[i]);
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

Activations quantize_activations(const float* x, int64_t M, int64_t K, bool portable) {
  Activations a;
  a.chunks = K / 32;
  a.q.resize(M * K);
  a.scale.resize(M * a.chunks);
  a.sum.resize(M * a.chunks);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t c = 0; c < a.chunks; ++c) {
      const int64_t rc = r * a.chunks + c;
#ifdef PDSERVE_AVX2
      if (!portable) {
        quantize_chunk_avx2(x + r * K + 32 * c, a.q.data() + r * K + 32 * c, a.scale[rc], a.sum[rc]);
        continue;
      }
#endif
      quantize_chunk_scalar(x + r * K + 32 * c, a.q.data() + r * K + 32 * c, a.scale[rc], a.sum[rc]);
    }
  (void)portable;
  return a;
}

void qlinear(torch::Tensor out, torch::Tensor x, torch::Tensor w, int64_t qtype, bool portable) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const Layout l = layout_of(qtype);
  TORCH_CHECK(l.elems > 0, "quantization type ", qtype, " has no kernel");
  TORCH_CHECK(K % l.elems == 0 && w.size(1) == K / l.elems * l.bytes, "qlinear: bad shapes");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = w.size(1);
  const Activations a = quantize_activations(x.data_ptr<float>(), M, K, portable);
#ifdef PDSERVE_AVX2
  if (!portable) {
    dispatch(qtype, [&](auto t) { qlinear_avx2<decltype(t)::value>(wp, row_bytes, N, K, a, M, op); });
    return;
  }
#endif
  // One work item is one output column; a thread takes a contiguous run of them.
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) row_dot_scalar(qtype, wp + n * row_bytes, K, a, M, op + n, N);
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
