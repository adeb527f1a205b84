// specjax_dense_nk: y[M, N] = x[M, K] . w[N, K]^T in fp32, for the few-row products of decoding.
//
// XLA:CPU hands a product with M > 1 rows to a GEMM that packs the weight for every call, so a
// 5-row verify window costs 2-4x a 1-row decode step although both read the same weights. This
// kernel streams each weight row once (rows are contiguous in the [N, K] layout) and multiplies it
// with all M rows of x, which stay in cache: the product costs what reading the weights costs until
// M is large enough for the FLOPs to matter. Work is split over XLA's intra-op thread pool in blocks
// of weight rows. Portable C++ (GCC vector extensions, no intrinsics); built at first use by
// `specjax.models.linear` with the machine's compiler, which falls back to XLA's dot without it.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64), aligned(4)));  // unaligned loads

inline float hsum(v16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

constexpr int NB = 8;     // weight rows per block: eight sequential streams keep the memory busy
constexpr int64_t KC = 256;  // k-chunk: NB rows x KC floats (8 KiB) stay in L1 across the row tiles

// acc[i][j] (+)= x[m0 + i, k0:k1] . w[n0 + j, k0:k1] over whole 16-float steps, for MT rows of x
template <int MT>
inline void chunk(const float* __restrict x, const float* __restrict w, v16* __restrict acc, int64_t K,
                  int64_t m0, int64_t n0, int64_t k0, int64_t k1, bool first) {
  v16 a[MT][NB];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) a[i][j] = first ? (v16){} : acc[(m0 + i) * NB + j];
  for (int64_t k = k0; k < k1; k += 16) {
    v16 xv[MT];
    for (int i = 0; i < MT; ++i) xv[i] = *reinterpret_cast<const v16*>(x + (m0 + i) * K + k);
    for (int j = 0; j < NB; ++j) {
      v16 wv = *reinterpret_cast<const v16*>(w + (n0 + j) * K + k);
      for (int i = 0; i < MT; ++i) a[i][j] += xv[i] * wv;
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) acc[(m0 + i) * NB + j] = a[i][j];
}

// y[:, n0:n0+NB] for all M rows: k in chunks, and within a chunk the rows of x in tiles of 3 (24
// accumulators), so each weight chunk is read from memory once and from L1 by the other tiles
void block(const float* x, const float* w, float* y, v16* acc, int64_t M, int64_t K, int64_t N, int64_t n0) {
  const int64_t K16 = K & ~int64_t(15);
  for (int64_t k0 = 0; k0 < K16 || k0 == 0; k0 += KC) {
    int64_t k1 = std::min(k0 + KC, K16);
    bool first = k0 == 0;
    int64_t m = 0;
    for (; m + 3 <= M; m += 3) chunk<3>(x, w, acc, K, m, n0, k0, k1, first);
    if (M - m == 2) chunk<2>(x, w, acc, K, m, n0, k0, k1, first);
    if (M - m == 1) chunk<1>(x, w, acc, K, m, n0, k0, k1, first);
    if (K16 == 0) break;
  }
  for (int64_t m = 0; m < M; ++m)
    for (int j = 0; j < NB; ++j) {
      float s = hsum(acc[m * NB + j]);
      for (int64_t k = K16; k < K; ++k) s += x[m * K + k] * w[(n0 + j) * K + k];
      y[m * N + n0 + j] = s;
    }
}

// weight rows [n0, n1): blocks of NB, then the last few one at a time
void weight_rows(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
                 int64_t n0, int64_t n1) {
  std::unique_ptr<v16[]> acc(new v16[M * NB]);
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) block(x, w, y, acc.get(), M, K, N, n);
  const int64_t K16 = K & ~int64_t(15);
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      v16 a = (v16){};
      for (int64_t k = 0; k < K16; k += 16)
        a += *reinterpret_cast<const v16*>(x + m * K + k) * *reinterpret_cast<const v16*>(w + n * K + k);
      float s = hsum(a);
      for (int64_t k = K16; k < K; ++k) s += x[m * K + k] * w[n * K + k];
      y[m * N + n] = s;
    }
}

// Blocks of weight rows handed out by an atomic counter; the calling thread works too, so it never
// waits for a task that has not started (no deadlock when the pool is busy), only for running ones.
struct Work {
  const float *x, *w;
  float* y;
  int64_t M, K, N, block, nblocks;
  std::atomic<int64_t> next{0}, done{0};
  void run() {
    for (int64_t b; (b = next.fetch_add(1, std::memory_order_relaxed)) < nblocks;) {
      int64_t n0 = b * block, n1 = std::min(n0 + block, N);
      weight_rows(x, w, y, M, K, N, n0, n1);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error DenseNK(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || xd[1] != wd[1] || yd[0] != xd[0] ||
      yd[1] != wd[0])
    return ffi::Error::InvalidArgument(
        "specjax_dense_nk: needs x [M, K], w [N, K] and a result [M, N] (fp32)");
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->w = w.typed_data();
  work->y = y->typed_data();
  work->M = xd[0];
  work->K = xd[1];
  work->N = wd[0];
  if (work->M == 0 || work->N == 0) return ffi::Error::Success();
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // a few blocks per thread (load balance on a busy machine), each at least ~64 KiB of weights
  int64_t block = (work->N + 4 * threads - 1) / (4 * threads);
  block = std::max<int64_t>(block, (1 << 16) / (4 * std::max<int64_t>(work->K, 1)));
  block = std::max<int64_t>(NB, (block + NB - 1) / NB * NB);
  work->block = block;
  work->nblocks = (work->N + block - 1) / block;
  // a weight under ~2 MiB streams in less time than waking another thread can take: run it here
  int64_t helpers = work->N * work->K < (int64_t(1) << 19) ? 0 : std::min(threads, work->nblocks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->run(); });
  work->run();
  while (work->done.load(std::memory_order_acquire) < work->nblocks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_dense_nk, DenseNK,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
