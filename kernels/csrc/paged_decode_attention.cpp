// Decode attention over a paged KV pool, for CPUs.
//
// One query token per sequence attends to its whole context, read in place from the
// pool's blocks: no gather into a contiguous copy (which costs as much memory traffic as
// the attention itself). Each (sequence, kv head) pair is independent work, so the
// output of a sequence does not depend on what else is in the batch.
//
// Shapes (checked by the Python launcher, kernels/paged_attention.py):
//   q            [B, Hq, D]            float32, contiguous
//   k_pool/v_pool[N, block, Hkv, D]    float32, contiguous (one layer of the pool)
//   block_tables [B, max_blocks]       int64
//   context_lens [B]                   int64
//   out          [B, Hq, D]            float32
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_AVX2 1
#endif

namespace {

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

#ifdef PDSERVE_AVX2
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}
#endif

// scores[g] = <q[g], k> for the G query heads of one kv head: k is loaded once.
inline void group_dots(const float* __restrict q, const float* __restrict k, int64_t G,
                       int64_t D, float* __restrict out) {
#ifdef PDSERVE_AVX2
  if (D % 8 == 0) {
    int64_t g = 0;
    for (; g + 3 <= G; g += 3) {  // three independent FMA chains hide FMA latency
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps();
      const float *q0 = q + g * D, *q1 = q0 + D, *q2 = q1 + D;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 kv = _mm256_loadu_ps(k + d);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + d), kv, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + d), kv, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + d), kv, a2);
      }
      out[g] = hsum(a0);
      out[g + 1] = hsum(a1);
      out[g + 2] = hsum(a2);
    }
    for (; g < G; ++g) out[g] = dot(q + g * D, k, D);
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g) out[g] = dot(q + g * D, k, D);
}

// o[g] += p[g] * v for the G query heads of one kv head: v is loaded once.
inline void group_axpy(float* __restrict o, const float* __restrict p,
                       const float* __restrict v, int64_t G, int64_t D) {
#ifdef PDSERVE_AVX2
  if (D % 8 == 0) {
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 vv = _mm256_loadu_ps(v + d);
      for (int64_t g = 0; g < G; ++g) {
        float* og = o + g * D + d;
        _mm256_storeu_ps(og, _mm256_fmadd_ps(_mm256_set1_ps(p[g]), vv, _mm256_loadu_ps(og)));
      }
    }
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g) axpy(o + g * D, p[g], v, D);
}

// In-place softmax of one row. The exp loop is written to be vectorised (libmvec).
inline void softmax(float* __restrict x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    x[i] = expf(x[i] - m);
    sum += x[i];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

// Rows of one block are contiguous but blocks are scattered through the pool, so the
// hardware prefetcher loses the stream at every block boundary: ask for the next block
// (keys or values of all heads, block * Hkv * D floats) while this one is being used.
inline void prefetch_block(const float* block_base, int64_t nbytes) {
  const char* p = reinterpret_cast<const char*>(block_base);
  for (int64_t off = 0; off < nbytes; off += 64) __builtin_prefetch(p + off);
}

}  // namespace

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_pool,
                            torch::Tensor v_pool, torch::Tensor block_tables,
                            torch::Tensor context_lens, double scale) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t block = k_pool.size(1), Hkv = k_pool.size(2);
  const int64_t G = Hq / Hkv;
  TORCH_CHECK(Hq <= 64, "paged_decode_attention supports at most 64 query heads");
  const int64_t max_blocks = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int64_t tok_stride = Hkv * D;             // between tokens inside a block
  const int64_t blk_stride = block * tok_stride;  // between blocks

  // One work item is one sequence with all its heads, so each token's key (and value)
  // row of Hkv * D floats is read once, front to back: the hardware prefetcher streams
  // whole blocks instead of striding through them once per head.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // [Hq, len]: head-major so the softmax runs on contiguous rows
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lens[b];
      const int64_t* table = tables + b * max_blocks;
      scores.resize(static_cast<size_t>(Hq * len));
      float* s = scores.data();
      const float* qb = qp + b * Hq * D;
      const int64_t nblk = (len + block - 1) / block;
      const int64_t blk_bytes = blk_stride * static_cast<int64_t>(sizeof(float));
      prefetch_block(kp + table[0] * blk_stride, blk_bytes);
      for (int64_t t = 0; t < len; ++t) {
        if (t % block == 0 && t / block + 1 < nblk) prefetch_block(kp + table[t / block + 1] * blk_stride, blk_bytes);
        const float* k = kp + table[t / block] * blk_stride + (t % block) * tok_stride;
        float dots[64];
        for (int64_t h = 0; h < Hkv; ++h) group_dots(qb + h * G * D, k + h * D, G, D, dots + h * G);
        for (int64_t hq = 0; hq < Hq; ++hq) s[hq * len + t] = dots[hq] * fscale;
      }
      for (int64_t hq = 0; hq < Hq; ++hq) softmax(s + hq * len, len);
      float* ob = op + b * Hq * D;
      std::fill(ob, ob + Hq * D, 0.f);
      prefetch_block(vp + table[0] * blk_stride, blk_bytes);
      for (int64_t t = 0; t < len; ++t) {
        if (t % block == 0 && t / block + 1 < nblk) prefetch_block(vp + table[t / block + 1] * blk_stride, blk_bytes);
        const float* v = vp + table[t / block] * blk_stride + (t % block) * tok_stride;
        float p[64];
        for (int64_t hq = 0; hq < Hq; ++hq) p[hq] = s[hq * len + t];
        for (int64_t h = 0; h < Hkv; ++h) group_axpy(ob + h * G * D, p + h * G, v + h * D, G, D);
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV pool (float32, CPU)");
}
