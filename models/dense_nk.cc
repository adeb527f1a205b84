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

// y[m0:m0+MT, n0:n0+NB] from x rows m0.. and weight rows n0..
template <int MT, int NB>
void tile(const float* __restrict x, const float* __restrict w, float* __restrict y, int64_t K,
          int64_t N, int64_t m0, int64_t n0) {
  v16 acc[MT][NB];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = (v16){};
  const float* xr = x + m0 * K;
  const float* wr = w + n0 * K;
  const int64_t K16 = K & ~int64_t(15);
  for (int64_t k = 0; k < K16; k += 16) {
    v16 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = *reinterpret_cast<const v16*>(wr + j * K + k);
    for (int i = 0; i < MT; ++i) {
      v16 xv = *reinterpret_cast<const v16*>(xr + i * K + k);
      for (int j = 0; j < NB; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t k = K16; k < K; ++k) s += xr[i * K + k] * wr[j * K + k];
      y[(m0 + i) * N + n0 + j] = s;
    }
}

// all M rows against weight rows [n0, n0 + NB): tiles of 8 rows x 2 weight rows (16 accumulators),
// a remainder of r < 8 rows against 2 or 4 weight rows
template <int NB>
void rows_block(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8)
    for (int j = 0; j < NB; j += 2) tile<8, 2>(x, w, y, K, N, m, n0 + j);
  switch (M - m) {
#define SPECJAX_TAIL(R, B)                                                  \
  case R:                                                                   \
    for (int j = 0; j < NB; j += B) tile<R, B>(x, w, y, K, N, m, n0 + j); \
    break;
    SPECJAX_TAIL(7, 2)
    SPECJAX_TAIL(6, 2)
    SPECJAX_TAIL(5, 2)
    SPECJAX_TAIL(4, 4)
    SPECJAX_TAIL(3, 4)
    SPECJAX_TAIL(2, 4)
    SPECJAX_TAIL(1, 4)
#undef SPECJAX_TAIL
    default:
      break;
  }
}

void weight_rows(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
                 int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) rows_block<4>(x, w, y, M, K, N, n);
  for (; n < n1; ++n) {  // the last N % 4 weight rows, one at a time
    for (int64_t m = 0; m < M; ++m) tile<1, 1>(x, w, y, K, N, m, n);
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
  block = std::max<int64_t>(4, (block + 3) & ~int64_t(3));
  work->block = block;
  work->nblocks = (work->N + block - 1) / block;
  int64_t helpers = std::min(threads, work->nblocks) - 1;
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
