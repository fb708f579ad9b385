// Decode attention over a paged KV pool, for CPUs.
//
// One query token per sequence attends to its whole context, read in place from the
// pool's blocks: no gather into a contiguous copy (which costs as much memory traffic as
// the attention itself). Each (sequence, kv head) pair is independent work, so the
// output of a sequence does not depend on what else is in the batch.
//
// Shapes (checked by the Python launcher, kernels/paged_attention.py):
//   q            [B, Hq, D]            float32, contiguous
//   k_pool/v_pool[N, block, Hkv, D]    float32 or float16, contiguous (one layer of the pool)
//   block_tables [B, max_blocks]       int64
//   context_lens [B]                   int64
//   out          [B, Hq, D]            float32
//
// A float16 pool is read as stored and widened to float32 in registers (F16C where the CPU
// has it): half the bytes per step, the same float32 arithmetic on the widened values.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_AVX2 1
#include "simd_exp.h"
#endif

namespace {

// A pool element as float32 (KV is float or at::Half).
inline float widen(float x) { return x; }
inline float widen(at::Half x) { return static_cast<float>(x); }

template <typename KV>
inline float dot(const float* __restrict a, const KV* __restrict b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * widen(b[i]);
  return acc;
}

template <typename KV>
inline void axpy(float* __restrict y, float a, const KV* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * widen(x[i]);
}


#ifdef PDSERVE_AVX2
// 8 pool elements as float32 lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The 8 horizontal sums of a0..a7, as one vector (lane j = sum of aj).
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                    __m256 a6, __m256 a7) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// out[j] = <q, k_j> for the 8 rows k_j = k + j * stride (D a multiple of 8).
template <typename KV>
inline void dots8(const float* __restrict q, const KV* __restrict k, int64_t stride,
                  int64_t D, float* __restrict out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    const KV* kd = k + d;
    a0 = _mm256_fmadd_ps(qv, load8(kd), a0);
    a1 = _mm256_fmadd_ps(qv, load8(kd + stride), a1);
    a2 = _mm256_fmadd_ps(qv, load8(kd + 2 * stride), a2);
    a3 = _mm256_fmadd_ps(qv, load8(kd + 3 * stride), a3);
    a4 = _mm256_fmadd_ps(qv, load8(kd + 4 * stride), a4);
    a5 = _mm256_fmadd_ps(qv, load8(kd + 5 * stride), a5);
    a6 = _mm256_fmadd_ps(qv, load8(kd + 6 * stride), a6);
    a7 = _mm256_fmadd_ps(qv, load8(kd + 7 * stride), a7);
  }
  _mm256_storeu_ps(out, hsum8(a0, a1, a2, a3, a4, a5, a6, a7));
}

// acc[0..NV) += p * v[0 .. 8 NV) over the rows of one block, accumulators in registers.
template <int NV, typename KV>
inline void weighted_rows(const float* __restrict p, const KV* __restrict v, int64_t stride,
                          int64_t rows, __m256* __restrict acc) {
  __m256 a[NV];
  for (int c = 0; c < NV; ++c) a[c] = acc[c];
  for (int64_t j = 0; j < rows; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const KV* vj = v + j * stride;
    for (int c = 0; c < NV; ++c) a[c] = _mm256_fmadd_ps(pj, load8(vj + 8 * c), a[c]);
  }
  for (int c = 0; c < NV; ++c) acc[c] = a[c];
}
#endif

// In-place softmax of one row.
inline void softmax(float* __restrict x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  float sum = 0.f;
  int64_t i = 0;
#ifdef PDSERVE_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
    _mm256_storeu_ps(x + i, e);
    sv = _mm256_add_ps(sv, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sv);
  for (float l : lanes) sum += l;
#endif
  for (; i < n; ++i) {
    x[i] = expf(x[i] - m);
    sum += x[i];
  }
  const float inv = 1.f / sum;
  for (int64_t j = 0; j < n; ++j) x[j] *= inv;
}

// Ask for `rows` rows of D elements, `stride` apart, ahead of their use, at __builtin_prefetch's
// LOCALITY (attend asks for 2, into L2: the keys two blocks ahead, this block's values).
// A block's rows of one kv head are short runs at a stride, at a place the block table
// chooses: the hardware prefetcher does not follow them, and waiting on each line costs
// more than the arithmetic (measured: 21 vs 7 ms a batch-8 step from memory vs cache).
template <int LOCALITY, typename KV>
inline void prefetch_rows(const KV* p, int64_t rows, int64_t stride, int64_t D) {
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(KV));
  for (int64_t j = 0; j < rows; ++j) {
    const char* r = reinterpret_cast<const char*>(p + j * stride);
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(r + b, 0, LOCALITY);
  }
}

// One sequence, all heads: scores = q k^T * scale, softmax, out = p v.
// Keys and values are read block by block in place; within a block the rows of one kv
// head are `tok_stride` apart.
template <typename KV>
void attend(const float* __restrict qb, const KV* __restrict kp, const KV* __restrict vp,
            const int64_t* __restrict table, int64_t len, int64_t Hq, int64_t Hkv, int64_t D,
            int64_t block, int64_t tok_stride, int64_t blk_stride, float scale,
            float* __restrict ob, std::vector<float>& scores) {
  const int64_t G = Hq / Hkv;
  scores.resize(static_cast<size_t>(Hq * len));
  float* s = scores.data();
  const int64_t nblk = (len + block - 1) / block;
  const bool vec = D % 8 == 0;
#ifndef PDSERVE_AVX2
  (void)vec;
#endif
  for (int64_t bi = 0; bi < nblk; ++bi) {
    const int64_t t0 = bi * block, rows = std::min(block, len - t0);
    const KV* kblk = kp + table[bi] * blk_stride;
    if (bi + 2 < nblk)
      for (int64_t h = 0; h < Hkv; ++h)
        prefetch_rows<2>(kp + table[bi + 2] * blk_stride + h * D,
                         std::min(block, len - t0 - 2 * block), tok_stride, D);
    for (int64_t h = 0; h < Hkv; ++h)
      prefetch_rows<2>(vp + table[bi] * blk_stride + h * D, rows, tok_stride, D);
    for (int64_t hq = 0; hq < Hq; ++hq) {
      const float* q = qb + hq * D;
      const KV* k = kblk + (hq / G) * D;
      float* srow = s + hq * len + t0;
      int64_t j = 0;
#ifdef PDSERVE_AVX2
      if (vec)
        for (; j + 8 <= rows; j += 8) dots8(q, k + j * tok_stride, tok_stride, D, srow + j);
#endif
      for (; j < rows; ++j) srow[j] = dot(q, k + j * tok_stride, D);
    }
  }
  for (int64_t i = 0; i < Hq * len; ++i) s[i] *= scale;
  for (int64_t hq = 0; hq < Hq; ++hq) softmax(s + hq * len, len);
  std::fill(ob, ob + Hq * D, 0.f);
#ifdef PDSERVE_AVX2
  if (vec && D <= 64) {
    const int nv = static_cast<int>(D / 8);
    for (int64_t hq = 0; hq < Hq; ++hq) {
      __m256 acc[8];
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
      const float* p = s + hq * len;
      for (int64_t bi = 0; bi < nblk; ++bi) {
        const int64_t t0 = bi * block, rows = std::min(block, len - t0);
        const KV* v = vp + table[bi] * blk_stride + (hq / G) * D;
        switch (nv) {
          case 8: weighted_rows<8>(p + t0, v, tok_stride, rows, acc); break;
          case 4: weighted_rows<4>(p + t0, v, tok_stride, rows, acc); break;
          case 2: weighted_rows<2>(p + t0, v, tok_stride, rows, acc); break;
          default:
            for (int64_t j = 0; j < rows; ++j) axpy(ob + hq * D, p[t0 + j], v + j * tok_stride, D);
        }
      }
      if (nv == 8 || nv == 4 || nv == 2)
        for (int c = 0; c < nv; ++c) _mm256_storeu_ps(ob + hq * D + 8 * c, acc[c]);
    }
    return;
  }
#endif
  for (int64_t bi = 0; bi < nblk; ++bi) {
    const int64_t t0 = bi * block, rows = std::min(block, len - t0);
    const KV* vblk = vp + table[bi] * blk_stride;
    for (int64_t j = 0; j < rows; ++j)
      for (int64_t hq = 0; hq < Hq; ++hq)
        axpy(ob + hq * D, s[hq * len + t0 + j], vblk + j * tok_stride + (hq / G) * D, D);
  }
}

template <typename KV>
void run(torch::Tensor out, torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
         torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t block = k_pool.size(1), Hkv = k_pool.size(2);
  const int64_t max_blocks = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  const KV* kp = k_pool.data_ptr<KV>();
  const KV* vp = v_pool.data_ptr<KV>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int64_t tok_stride = Hkv * D;             // between tokens inside a block
  const int64_t blk_stride = block * tok_stride;  // between blocks

  // One work item is one sequence's group of query heads over one kv head (so a batch of
  // one still spreads over the threads); a head's output does not depend on what else is in
  // the batch. attend() sees the group as Hq = G heads over a single kv head.
  const int64_t G = Hq / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // [G, len]: head-major so the softmax runs on contiguous rows
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      attend(qp + (b * Hq + h * G) * D, kp + h * D, vp + h * D, tables + b * max_blocks,
             lens[b], G, 1, D, block, tok_stride, blk_stride, fscale,
             op + (b * Hq + h * G) * D, scores);
    }
  });
}

}  // namespace

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_pool,
                            torch::Tensor v_pool, torch::Tensor block_tables,
                            torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.size(1) <= 64, "paged_decode_attention supports at most 64 query heads");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "k_pool and v_pool differ in dtype");
  if (k_pool.scalar_type() == at::kHalf)
    run<at::Half>(out, q, k_pool, v_pool, block_tables, context_lens, scale);
  else
    run<float>(out, q, k_pool, v_pool, block_tables, context_lens, scale);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged float32 or float16 KV pool (CPU)");
}
