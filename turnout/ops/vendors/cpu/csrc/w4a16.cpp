// w4a16 on the CPU, reading the packed 4-bit blocks in registers (turnout/ops/reference/w4a16.py has the layout):
// built on first use by turnout/ops/vendors/cpu/native.py with this machine's compiler (-O3 -march=native
// -fopenmp; the OpenMP runtime is torch's own libgomp, already loaded), registered as torch.ops.turnout_cpu.*.
//
// qweight uint8 [N, K/2]: rows in blocks of 64, byte [b, k, j] = q[64 b + j, k] | q[64 b + 32 + j, k] << 4, so one
// block's 64 values of column k are 32 contiguous bytes. scale_zeros [K/G, N, 2] (float32, float16 or bfloat16):
// w[n, k] = (q - 8) s + z = q s + (z - 8 s).
//
// Three paths by the number of rows M of x (float32 [M, K]):
//  * M == 1 (decode): per block and group, 64 accumulators in registers, the 4-bit values widened in registers
//    (never written as floats); y = sum_g s_g A_g + (z - 8 s)_g X_g with A_g = sum_k x q, X_g = sum_k x.
//  * 1 < M <= TILE_ROWS: per block and group, the group's values widened once into a float tile in L1, then each
//    row's dot runs over the tile (the weight is read from memory once for all rows).
//  * larger M (prefill): the weight dequantised into a float32 [K, N] (each block's 64 values of a column
//    contiguous) and one at::mm (the BLAS GEMM).
// Blocks of 64 rows are split over torch's intra-op threads (at::parallel_for). Values are the reference's; the
// order of the sums differs (float32 rounding, ~1e-7 relative).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TURNOUT_AVX2 1
#endif

namespace {

constexpr int64_t ROWS = 64;

constexpr int64_t TILE_ROWS = 32;  // up to this many rows the tiled path; beyond, dequantise + GEMM (measured: docs/benchmarks.md)

// The group's scale s and shifted zero z - 8 s of one block's 64 rows, as float32.
template <typename T>
inline void block_scales(const T* sz, int64_t g, int64_t n0, int64_t N, float* s, float* z2) {
  const T* p = sz + 2 * (g * N + n0);
  for (int64_t j = 0; j < ROWS; ++j) {
    const float sc = static_cast<float>(p[2 * j]);
    s[j] = sc;
    z2[j] = static_cast<float>(p[2 * j + 1]) - 8.f * sc;
  }
}

// One block (64 rows) of y = x W^T for one row x: the 4-bit values widened in registers.
template <typename T>
void block_one_row(const float* x, int64_t K, int64_t G, const uint8_t* blk, const T* sz, int64_t n0, int64_t N,
                   float* y) {
  alignas(64) float s[ROWS], z2[ROWS], out[ROWS];
  for (int64_t j = 0; j < ROWS; ++j) out[j] = 0.f;
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += G, ++g) {
    block_scales(sz, g, n0, N, s, z2);
    float xs = 0.f;
    for (int64_t k = g0; k < g0 + G; ++k) xs += x[k];
#ifdef TURNOUT_AVX2
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int64_t k = g0; k < g0 + G; ++k) {
      const __m256 xk = _mm256_broadcast_ss(x + k);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + k * 32));
      const __m256i lo = _mm256_and_si256(v, mask);                          // rows 0..31
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);  // rows 32..63
      const __m128i l0 = _mm256_castsi256_si128(lo), l1 = _mm256_extracti128_si256(lo, 1);
      const __m128i h0 = _mm256_castsi256_si128(hi), h1 = _mm256_extracti128_si256(hi, 1);
#define TURNOUT_Q(v8) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v8))
      acc[0] = _mm256_fmadd_ps(xk, TURNOUT_Q(l0), acc[0]);
      acc[1] = _mm256_fmadd_ps(xk, TURNOUT_Q(_mm_srli_si128(l0, 8)), acc[1]);
      acc[2] = _mm256_fmadd_ps(xk, TURNOUT_Q(l1), acc[2]);
      acc[3] = _mm256_fmadd_ps(xk, TURNOUT_Q(_mm_srli_si128(l1, 8)), acc[3]);
      acc[4] = _mm256_fmadd_ps(xk, TURNOUT_Q(h0), acc[4]);
      acc[5] = _mm256_fmadd_ps(xk, TURNOUT_Q(_mm_srli_si128(h0, 8)), acc[5]);
      acc[6] = _mm256_fmadd_ps(xk, TURNOUT_Q(h1), acc[6]);
      acc[7] = _mm256_fmadd_ps(xk, TURNOUT_Q(_mm_srli_si128(h1, 8)), acc[7]);
#undef TURNOUT_Q
    }
    const __m256 xsv = _mm256_set1_ps(xs);
    for (int i = 0; i < 8; ++i) {
      __m256 o = _mm256_load_ps(out + 8 * i);
      o = _mm256_fmadd_ps(acc[i], _mm256_load_ps(s + 8 * i), o);
      o = _mm256_fmadd_ps(xsv, _mm256_load_ps(z2 + 8 * i), o);
      _mm256_store_ps(out + 8 * i, o);
    }
#else
    alignas(64) float acc[ROWS];
    for (int64_t j = 0; j < ROWS; ++j) acc[j] = 0.f;
    for (int64_t k = g0; k < g0 + G; ++k) {
      const float xk = x[k];
      const uint8_t* p = blk + k * 32;
      for (int64_t j = 0; j < 32; ++j) {
        acc[j] += xk * static_cast<float>(p[j] & 15);
        acc[j + 32] += xk * static_cast<float>(p[j] >> 4);
      }
    }
    for (int64_t j = 0; j < ROWS; ++j) out[j] += acc[j] * s[j] + xs * z2[j];
#endif
  }
  std::memcpy(y, out, sizeof(out));
}

// acc[0..63] += sum_k x[k] t[k][0..63] over n rows of a float tile (t row stride 64).
inline void tile_dot(const float* x, const float* t, int64_t n, float* acc, float& xs) {
#ifdef TURNOUT_AVX2
  __m256 a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
  float sum = 0.f;
  for (int64_t k = 0; k < n; ++k) {
    const __m256 xk = _mm256_broadcast_ss(x + k);
    sum += x[k];
    const float* tk = t + k * ROWS;
    for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(xk, _mm256_loadu_ps(tk + 8 * i), a[i]);
  }
  for (int i = 0; i < 8; ++i) _mm256_store_ps(acc + 8 * i, a[i]);
  xs = sum;
#else
  float sum = 0.f;
  for (int64_t j = 0; j < ROWS; ++j) acc[j] = 0.f;
  for (int64_t k = 0; k < n; ++k) {
    const float xk = x[k];
    sum += xk;
    const float* tk = t + k * ROWS;
    for (int64_t j = 0; j < ROWS; ++j) acc[j] += xk * tk[j];
  }
  xs = sum;
#endif
}

// One block of y = x W^T for M rows: each group's values widened once into `tile` [G][64] (L1), then every row's
// dot over it; `out` [M][64] holds the block's partial sums.
template <typename T>
void block_rows(const float* x, int64_t M, int64_t K, int64_t G, const uint8_t* blk, const T* sz, int64_t n0,
                int64_t N, float* y, float* tile, float* out) {
  alignas(64) float s[ROWS], z2[ROWS], acc[ROWS];
  std::memset(out, 0, M * ROWS * sizeof(float));
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += G, ++g) {
    block_scales(sz, g, n0, N, s, z2);
    for (int64_t k = 0; k < G; ++k) {
      const uint8_t* p = blk + (g0 + k) * 32;
      float* t = tile + k * ROWS;
      for (int64_t j = 0; j < 32; ++j) {
        t[j] = static_cast<float>(p[j] & 15);
        t[j + 32] = static_cast<float>(p[j] >> 4);
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      float xs;
      tile_dot(x + m * K + g0, tile, G, acc, xs);
      float* om = out + m * ROWS;
      for (int64_t j = 0; j < ROWS; ++j) om[j] += acc[j] * s[j] + xs * z2[j];
    }
  }
  for (int64_t m = 0; m < M; ++m) std::memcpy(y + m * N + n0, out + m * ROWS, ROWS * sizeof(float));
}

// The float32 weight transposed, wt [K, N]: block b's 64 values of column k are the 32 bytes widened and land in
// wt[k, 64 b .. 64 b + 63], contiguous (the GEMM reads it as its [K, N] operand).
template <typename T>
void dequantize_blocks_t(const uint8_t* q, const T* sz, int64_t N, int64_t K, int64_t G, float* wt) {
  at::parallel_for(0, N / ROWS, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float s[ROWS], z2[ROWS];
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* blk = q + b * K * 32;
      for (int64_t g0 = 0, g = 0; g0 < K; g0 += G, ++g) {
        block_scales(sz, g, b * ROWS, N, s, z2);
        for (int64_t k = g0; k < g0 + G; ++k) {
          const uint8_t* p = blk + k * 32;
          float* w = wt + k * N + b * ROWS;
          for (int64_t j = 0; j < 32; ++j) {
            w[j] = static_cast<float>(p[j] & 15) * s[j] + z2[j];
            w[j + 32] = static_cast<float>(p[j] >> 4) * s[j + 32] + z2[j + 32];
          }
        }
      }
    }
  });
}

void check(const at::Tensor& qweight, const at::Tensor& scale_zeros, int64_t K, int64_t G) {
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "qweight: contiguous uint8 [N, K/2]");
  const int64_t N = qweight.size(0);
  TORCH_CHECK(N % ROWS == 0 && qweight.size(1) * 2 == K, "qweight ", qweight.sizes(), " for K = ", K);
  TORCH_CHECK(G > 0 && K % G == 0, "group size ", G, " must divide K = ", K);
  TORCH_CHECK(scale_zeros.is_contiguous() && scale_zeros.dim() == 3 && scale_zeros.size(0) == K / G &&
                  scale_zeros.size(1) == N && scale_zeros.size(2) == 2,
              "scale_zeros ", scale_zeros.sizes(), " must be contiguous [K/G, N, 2]");
}

#define TURNOUT_SZ_TYPES(sz, NAME, ...)                                                       \
  switch ((sz).scalar_type()) {                                                               \
    case at::kFloat: { using T = float; __VA_ARGS__(); break; }                               \
    case at::kHalf: { using T = c10::Half; __VA_ARGS__(); break; }                            \
    case at::kBFloat16: { using T = c10::BFloat16; __VA_ARGS__(); break; }                    \
    default: TORCH_CHECK(false, NAME ": scale_zeros must be float32, float16 or bfloat16"); \
  }

// The float32 weight [N, K] (a transposed view of a contiguous [K, N]).
at::Tensor w4a16_dequantize(const at::Tensor& qweight, const at::Tensor& scale_zeros, int64_t group_size) {
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  check(qweight, scale_zeros, K, group_size);
  auto wt = at::empty({K, N}, qweight.options().dtype(at::kFloat));
  TURNOUT_SZ_TYPES(scale_zeros, "w4a16_dequantize", [&] {
    dequantize_blocks_t(qweight.data_ptr<uint8_t>(), scale_zeros.data_ptr<T>(), N, K, group_size,
                        wt.data_ptr<float>());
  });
  return wt.t();
}

at::Tensor w4a16_mm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale_zeros,
                    int64_t group_size) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0), G = group_size;
  check(qweight, scale_zeros, K, G);
  if (M > TILE_ROWS) return at::mm(x, w4a16_dequantize(qweight, scale_zeros, G).t());  // BLAS on the [K, N] buffer
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = qweight.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  TURNOUT_SZ_TYPES(scale_zeros, "w4a16_mm", [&] {
    const T* szp = scale_zeros.data_ptr<T>();
    at::parallel_for(0, N / ROWS, 1, [&](int64_t b0, int64_t b1) {
      if (M == 1) {
        for (int64_t b = b0; b < b1; ++b)
          block_one_row(xp, K, G, qp + b * K * 32, szp, b * ROWS, N, yp + b * ROWS);
      } else {
        std::vector<float> tile(G * ROWS), out(M * ROWS);
        for (int64_t b = b0; b < b1; ++b)
          block_rows(xp, M, K, G, qp + b * K * 32, szp, b * ROWS, N, yp, tile.data(), out.data());
      }
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(turnout_cpu, m) {
  m.def("w4a16_mm(Tensor x, Tensor qweight, Tensor scale_zeros, int group_size) -> Tensor", &w4a16_mm);
  m.def("w4a16_dequantize(Tensor qweight, Tensor scale_zeros, int group_size) -> Tensor", &w4a16_dequantize);
}
