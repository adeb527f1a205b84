// specjax_dense_nk: y[M, N] = x[M, K] . w[N, K]^T in fp32, for the few-row products of decoding.
//
// XLA:CPU hands a product with M > 1 rows to a GEMM that packs the weight for every call, so a
// 5-row verify window costs 2-4x a 1-row decode step although both read the same weights. This
// kernel streams each weight row once (rows are contiguous in the [N, K] layout) and multiplies it
// with all M rows of x, which stay in cache: the product costs what reading the weights costs until
// M is large enough for the FLOPs to matter. Work is split over XLA's intra-op thread pool in blocks
// of weight rows. Portable C++ (GCC vector extensions, no intrinsics; one empty asm on x86 keeps a
// weight vector in a register); built at first use by `specjax.models.linear` with the machine's
// compiler, which falls back to XLA's dot without it.
//
// At 9-16 rows the product is compute-bound on a small CPU, so the register tile matters: 3 rows of
// x by 8 weight rows (24 zmm accumulators) with each weight vector loaded once per step (11 loads
// per 24 FMAs), the 8 sums of a row reduced with one shuffle tree, and the next block of weight rows
// prefetched while the first tile reads the current one. Single-threaded on Zen 4 with hot weights
// this runs q [576 x 576] at 16 rows near the FMA peak (~90 GFLOP/s), 2.2x the previous tile's.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The vector and the register tile by ISA. AVX-512 (32 zmm): 16 lanes, 3 rows of x by 8 weight rows
// (24 accumulators + 3 x + 1 w). AVX/AVX2 (16 ymm): 8 lanes, 3 by 4 (12 + 3 + 1): the AVX-512 tile
// there would be 48 ymm accumulators, spilled on every step (measured 3-5x slower per row on Zen 2).
// Elsewhere (NEON's 32 q registers, or no SIMD) the 16-lane tile, which GCC splits.
#if defined(__x86_64__) && defined(__AVX__) && !defined(__AVX512F__)
#define SPECJAX_VW8 1
constexpr int VW = 8;      // floats per vector
constexpr int NB = 4;      // weight rows per block
#else
#define SPECJAX_VW8 0
constexpr int VW = 16;
constexpr int NB = 8;      // eight sequential streams keep the memory busy
#endif
constexpr int MT_MAX = 3;  // rows of x per register tile

typedef float vf __attribute__((vector_size(VW * 4)));  // one vector: VW floats
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));  // for unaligned loads

inline vf load(const float* p) { return *reinterpret_cast<const vfu*>(p); }

// Keeps a loaded weight vector in a register: without it GCC folds the load into each of the MT
// FMAs that use it (a memory operand per FMA), and the tile is bound by L1 loads at half its FLOPs
// (measured 2x slower at 4-16 rows on Zen 4).
inline void pin(vf& v) {
#if defined(__x86_64__) && defined(__AVX512F__)
  asm("" : "+v"(v));
#elif defined(__x86_64__) && defined(__AVX__)
  asm("" : "+x"(v));
#else
  (void)v;
#endif
}

// The sums of NB accumulators, in order, into out[0..NB-1]: a shuffle tree (NB vector adds) instead
// of NB horizontal sums of VW lanes each (a chain of VW - 1 scalar adds apiece, which cost as much as
// the products themselves for K = 576).
inline void reduce_nb(const vf* a, float* out) {
#if SPECJAX_VW8 && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12))
  // [a0 | a1] and [a2 | a3], 4 partials each; then [a0, a2, a1, a3] x 2; then pairs
  vf b0 = __builtin_shufflevector(a[0], a[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[0], a[1], 4, 5, 6, 7, 12, 13, 14, 15);
  vf b1 = __builtin_shufflevector(a[2], a[3], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[2], a[3], 4, 5, 6, 7, 12, 13, 14, 15);
  vf c = __builtin_shufflevector(b0, b1, 0, 1, 8, 9, 4, 5, 12, 13) +
          __builtin_shufflevector(b0, b1, 2, 3, 10, 11, 6, 7, 14, 15);
  vf e = c + __builtin_shufflevector(c, c, 1, 0, 3, 2, 5, 4, 7, 6);
  out[0] = e[0];
  out[1] = e[4];
  out[2] = e[2];
  out[3] = e[6];
#elif !SPECJAX_VW8 && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12))
  vf b[4];
  for (int p = 0; p < 4; ++p)  // [a_2p: 8 partial sums | a_2p+1: 8]
    b[p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * p], a[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                   31);
  vf c[2];
  for (int q = 0; q < 2; ++q)  // c0: [a0, a2, a1, a3] x 4 partials; c1: [a4, a6, a5, a7]
    c[q] = __builtin_shufflevector(b[2 * q], b[2 * q + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * q], b[2 * q + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  // d: [a0, a4, a2, a6, a1, a5, a3, a7] x 2 partials
  vf d = __builtin_shufflevector(c[0], c[1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
          __builtin_shufflevector(c[0], c[1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  vf e = d + __builtin_shufflevector(d, d, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  const int at[NB] = {0, 8, 4, 12, 2, 10, 6, 14};
  for (int j = 0; j < NB; ++j) out[j] = e[at[j]];
#else
  for (int j = 0; j < NB; ++j) {
    float s = 0.f;
    for (int i = 0; i < VW; ++i) s += a[j][i];
    out[j] = s;
  }
#endif
}

// acc[i][j] (+)= x[m0 + i, k0:k1] . w[n0 + j, k0:k1] over whole vectors, for MT rows of x;
// `pf` (or null): the same offsets in the next block of weight rows, prefetched meanwhile
template <int MT>
inline void tile(const float* __restrict x, const float* __restrict w, vf* __restrict acc, int64_t K,
                 int64_t m0, int64_t n0, int64_t k0, int64_t k1, bool first, const float* pf) {
  vf a[MT][NB];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) a[i][j] = first ? (vf){} : acc[(m0 + i) * NB + j];
  const float* wr = w + n0 * K;
  for (int64_t k = k0; k < k1; k += VW) {
    vf xv[MT];
    for (int i = 0; i < MT; ++i) xv[i] = load(x + (m0 + i) * K + k);
    for (int j = 0; j < NB; ++j) {
      vf wv = load(wr + j * K + k);
      pin(wv);
      if (pf) __builtin_prefetch(pf + j * K + k, 0, 3);
      for (int i = 0; i < MT; ++i) a[i][j] += xv[i] * wv;
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) acc[(m0 + i) * NB + j] = a[i][j];
}

// y[:, n0:n0+NB] for all M rows. k in chunks of at most ~640 floats (NB rows of a chunk, <= 20 KiB,
// stay in L1), and within a chunk the rows of x in balanced tiles of at most MT_MAX, so each weight
// chunk is read from memory once (by the first tile, which also prefetches the next block's) and
// from L1 by the others.
void block(const float* x, const float* w, float* y, vf* acc, int64_t M, int64_t K, int64_t N, int64_t n0,
           int64_t kc) {
  const int64_t K16 = K & ~int64_t(VW - 1);
  const int64_t tiles = (M + MT_MAX - 1) / MT_MAX;
  const float* next = n0 + 2 * NB <= N ? w + (n0 + NB) * K : nullptr;
  for (int64_t k0 = 0; k0 < K16 || k0 == 0; k0 += kc) {
    int64_t k1 = std::min(k0 + kc, K16);
    bool first = k0 == 0;
    for (int64_t t = 0, m = 0; t < tiles; ++t) {
      int64_t mt = (M - m + (tiles - t) - 1) / (tiles - t);  // tile sizes differ by at most one
      const float* pf = t == 0 ? next : nullptr;
      if (mt == 3) tile<3>(x, w, acc, K, m, n0, k0, k1, first, pf);
      else if (mt == 2) tile<2>(x, w, acc, K, m, n0, k0, k1, first, pf);
      else tile<1>(x, w, acc, K, m, n0, k0, k1, first, pf);
      m += mt;
    }
    if (K16 == 0) break;
  }
  for (int64_t m = 0; m < M; ++m) {
    float s[NB];
    reduce_nb(acc + m * NB, s);
    for (int j = 0; j < NB; ++j) {
      for (int64_t k = K16; k < K; ++k) s[j] += x[m * K + k] * w[(n0 + j) * K + k];
      y[m * N + n0 + j] = s[j];
    }
  }
}

// weight rows [n0, n1): blocks of NB, then the last few one at a time
void weight_rows(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
                 int64_t n0, int64_t n1) {
  std::unique_ptr<vf[]> acc(new vf[M * NB]);
  const int64_t K16 = K & ~int64_t(VW - 1);
  const int64_t chunks = std::max<int64_t>(1, (K16 + 639) / 640);
  const int64_t kc = std::max<int64_t>(VW, (K16 / VW + chunks - 1) / chunks * VW);
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) block(x, w, y, acc.get(), M, K, N, n, kc);
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      vf a = (vf){};
      for (int64_t k = 0; k < K16; k += VW) a += load(x + m * K + k) * load(w + n * K + k);
      float s = 0.f;
      for (int i = 0; i < VW; ++i) s += a[i];
      for (int64_t k = K16; k < K; ++k) s += x[m * K + k] * w[n * K + k];
      y[m * N + n] = s;
    }
}

// The products of one x with up to kMaxParts weights (q/k/v, gate/up: one call, one split of the
// work over the threads, where three calls would each run their small product on one thread).
constexpr int kMaxParts = 4;
struct Part {
  const float* w;
  float* y;
  int64_t N, first;  // weight rows; index of its first block
};

// Blocks of weight rows handed out by an atomic counter; the calling thread works too, so it never
// waits for a task that has not started (no deadlock when the pool is busy), only for running ones.
struct Work {
  const float* x;
  Part parts[kMaxParts];
  int nparts = 0;
  int64_t M, K, block, nblocks;
  std::atomic<int64_t> next{0}, done{0};
  void run() {
    for (int64_t b; (b = next.fetch_add(1, std::memory_order_relaxed)) < nblocks;) {
      int p = 0;
      while (p + 1 < nparts && b >= parts[p + 1].first) ++p;
      const Part& q = parts[p];
      int64_t n0 = (b - q.first) * block, n1 = std::min(n0 + block, q.N);
      weight_rows(x, q.w, q.y, M, K, q.N, n0, n1);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Splits the weight rows of `work`'s parts (`W`: dense_nk's Work or qdense_nk's QWork) into blocks,
// hands them out over the pool, runs them on this thread too and waits for the last.
// `align`: blocks are a multiple of it (weight rows a kernel takes together).
template <class W>
void run_split(ffi::ThreadPool& pool, const std::shared_ptr<W>& work, int64_t total, int64_t align = NB) {
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // a few blocks per thread (load balance on a busy machine), each at least ~64 KiB of weights
  int64_t block = (total + 4 * threads - 1) / (4 * threads);
  block = std::max<int64_t>(block, (1 << 16) / (4 * std::max<int64_t>(work->K, 1)));
  block = std::max<int64_t>(align, (block + align - 1) / align * align);
  work->block = block;
  int64_t nblocks = 0;
  for (int p = 0; p < work->nparts; ++p) {
    work->parts[p].first = nblocks;
    nblocks += (work->parts[p].N + block - 1) / block;
  }
  work->nblocks = nblocks;
  // a product that takes less time than waking another thread can take runs here: weights under
  // 1 MiB at up to 8 rows (memory-bound), and from 8 rows on as much work in FLOPs (compute-bound).
  // Measured quiet (SmolLM2 forward, interleaved): against 2 MiB, 2-8% faster at 3-12 rows, where
  // the 1.3 MB o projection now uses both threads; 512 KiB was no better.
  int64_t work_units = total * work->K * std::max<int64_t>(8, work->M);
  int64_t helpers = work_units < (int64_t(4) << 19) ? 0 : std::min(threads, nblocks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->run(); });
  work->run();
  while (work->done.load(std::memory_order_acquire) < work->nblocks) std::this_thread::yield();
}

ffi::Error DenseNK(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws, ffi::RemainingRets ys) {
  auto xd = x.dimensions();
  const char* usage =
      "specjax_dense_nk: needs x [M, K], 1-4 weights w_i [N_i, K] and results [M, N_i] (fp32)";
  if (xd.size() != 2 || ws.size() < 1 || ws.size() > kMaxParts || ys.size() != ws.size())
    return ffi::Error::InvalidArgument(usage);
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->M = xd[0];
  work->K = xd[1];
  int64_t total = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::Buffer<ffi::F32>>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument(usage);
    auto wd = w->dimensions(), yd = (*y)->dimensions();
    if (wd.size() != 2 || yd.size() != 2 || wd[1] != xd[1] || yd[0] != xd[0] || yd[1] != wd[0])
      return ffi::Error::InvalidArgument(usage);
    work->parts[i] = Part{w->typed_data(), (*y)->typed_data(), wd[0], 0};
    total += wd[0];
  }
  work->nparts = static_cast<int>(ws.size());
  if (work->M == 0 || total == 0) return ffi::Error::Success();
  run_split(pool, work, total);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_dense_nk, DenseNK,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
