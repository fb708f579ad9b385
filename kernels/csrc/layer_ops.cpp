// The small per-layer operations of a Llama decoder, fused, for CPUs.
//
// At decode batch sizes a layer's matrix products take tens of microseconds, and the dozens
// of elementwise torch ops around them (each a dispatch and an allocation) cost as much
// again. Each function here is one pass over its rows, with the float32 arithmetic of the
// torch reference (engine/model.py, engine/rope.py, kernels/reference.py), in the same order
// where the reference's order is observable (RoPE and the KV write are bit-identical;
// norms and SiLU differ in the last bits: a sum's order, exp's rounding).
//
//   rms_norm(out, x, w, eps)              out = w * (x * rsqrt(mean(x^2) + eps))
//   add_rms_norm(out, x, d, w, eps)       x += d (in place), then out = rms_norm(x)
//   silu_mul(out, gu)                     out = silu(gu[:, :I]) * gu[:, I:]
//   rope_write_kv(qkv, cos, sin, pos, k_pool, v_pool, blocks, offsets, Hq, Hkv)
//       rotates q and k in place in the fused qkv rows, then stores k and v into the pool
//       (a float32 pool, or a float16 one: rounded to nearest even, as torch's cast)
//   row_sums(out, x)                      out[r] = the sum of row r, in one fixed order
//
// Shapes, dtypes and index ranges are checked by the Python launcher (kernels/layer_ops.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_AVX2 1
#include "simd_exp.h"
#endif

namespace {

inline void norm_row(float* __restrict out, const float* __restrict x, const float* __restrict w,
                     int64_t H, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) out[i] = w[i] * (x[i] * r);
}

// Store n floats into a pool of float32 (a copy) or float16 (rounded to nearest even).
inline void store_kv(float* __restrict dst, const float* __restrict src, int64_t n) {
  std::memcpy(dst, src, sizeof(float) * n);
}
inline void store_kv(at::Half* __restrict dst, const float* __restrict src, int64_t n) {
  int64_t i = 0;
#ifdef PDSERVE_AVX2
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) dst[i] = at::Half(src[i]);
}

template <typename KV>
void rope_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions,
                torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor slot_blocks,
                torch::Tensor slot_offsets, int64_t Hq, int64_t Hkv) {
  const int64_t T = qkv.size(0), W = qkv.size(1), D = cos.size(1), half = D / 2;
  const int64_t block = k_pool.size(1);
  const int64_t tok_stride = Hkv * D, blk_stride = block * tok_stride;
  float* qp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  KV* kp = k_pool.data_ptr<KV>();
  KV* vp = v_pool.data_ptr<KV>();
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* row = qp + t * W;
      const float* c = cp + pos[t] * D;
      const float* s = sp + pos[t] * D;
      // x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1): three roundings per
      // element, as the reference's mul, mul, add.
      for (int64_t h = 0; h < Hq + Hkv; ++h) {
        float* x = row + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          const float a = x1 * c[i], bb = (-x2) * s[i];
          const float a2 = x2 * c[i + half], b2 = x1 * s[i + half];
          x[i] = a + bb;
          x[i + half] = a2 + b2;
        }
      }
      const int64_t slot = blocks[t] * blk_stride + offsets[t] * tok_stride;
      store_kv(kp + slot, row + Hq * D, tok_stride);
      store_kv(vp + slot, row + (Hq + Hkv) * D, tok_stride);
    }
  });
}

}  // namespace

void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor w, double eps) {
  const int64_t M = x.size(0), H = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) norm_row(op + m * H, xp + m * H, wp, H, static_cast<float>(eps));
  });
}

void add_rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor d, torch::Tensor w,
                  double eps) {
  const int64_t M = x.size(0), H = x.size(1);
  float* xp = x.data_ptr<float>();
  const float* dp = d.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      float* xr = xp + m * H;
      const float* dr = dp + m * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) xr[i] = xr[i] + dr[i];
      norm_row(op + m * H, xr, wp, H, static_cast<float>(eps));
    }
  });
}

void silu_mul(torch::Tensor out, torch::Tensor gu) {
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      const float* g = gp + m * 2 * I;
      const float* u = g + I;
      float* o = op + m * I;
      int64_t i = 0;
#ifdef PDSERVE_AVX2
      const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
      for (; i + 8 <= I; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
      }
#endif
      for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
}

void rope_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                   torch::Tensor positions, torch::Tensor k_pool, torch::Tensor v_pool,
                   torch::Tensor slot_blocks, torch::Tensor slot_offsets, int64_t Hq,
                   int64_t Hkv) {
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "k_pool and v_pool differ in dtype");
  if (k_pool.scalar_type() == at::kHalf)
    rope_write<at::Half>(qkv, cos, sin, positions, k_pool, v_pool, slot_blocks, slot_offsets, Hq,
                         Hkv);
  else
    rope_write<float>(qkv, cos, sin, positions, k_pool, v_pool, slot_blocks, slot_offsets, Hq,
                      Hkv);
}

// Each row of x [B, V] summed alone in a fixed order: 32 running sums (element i into sum
// i % 32), added in order, then the tail. A row's sum is the same bits whatever the batch
// and however many threads run (torch's sum of one long row splits it across threads).
void row_sums(torch::Tensor out, torch::Tensor x) {
  constexpr int64_t S = 32;
  const int64_t B = x.size(0), V = x.size(1);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* row = xp + r * V;
      float part[S] = {};
      int64_t i = 0;
      for (; i + S <= V; i += S)
#pragma omp simd
        for (int64_t j = 0; j < S; ++j) part[j] += row[i + j];
      float sum = 0.f;
      for (int64_t j = 0; j < S; ++j) sum += part[j];
      for (; i < V; ++i) sum += row[i];
      op[r] = sum;
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows");
  m.def("add_rms_norm", &add_rms_norm, "x += d, then RMSNorm of x (float32 rows)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up over fused gate|up rows");
  m.def("rope_write_kv", &rope_write_kv, "RoPE on q and k in place, k and v into the pool");
  m.def("row_sums", &row_sums, "the sum of each float32 row, in a fixed order");
}
