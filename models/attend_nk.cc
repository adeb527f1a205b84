// specjax_attend: one attention layer's decode or verify window over a position-indexed KV cache,
// in fp32, on the CPU.
//
// XLA:CPU lowers the model's two attention einsums to dots that want the cache's kv-head axis in
// front: for a [B, S, Kv, H] buffer it writes a transposed copy of K and of V for every layer and
// every step, and copies the buffer again before its in-place update. At one token and a 640-slot
// cache that was ~0.7 ms a layer of copies around ~20 us of arithmetic (docs/BENCHMARKS.md, "The
// step, op by op"). This kernel reads the buffers where they are, only the slots a query sees.
//
// Inputs: q [B, T, Kv, G, H]; the cache with this forward's keys and values already written at
// slots hi[b] .. hi[b] + T - 1, k/v [B, S, Kv, H]; which of them each query sees, mask [B, T, T]
// (uint8); the committed slots each query sees, lo [B, T] .. hi [B] (exclusive: the context before
// the window, cut to a sliding window by lo). Output [B, T, Kv, G, H]:
//   softmax(scale * q . keys) . values over the keys a query sees, in ascending slot order.
// With `ring` 1, the buffers are a sliding-window layer's ring of S entries: slot s lives at entry
// s % S (models/kv_cache.py). The slots a window reads, lo .. hi + T - 1, span at most S, so each is
// one entry; they are still taken in slot (position) order, so a ring computes the same bits as a
// full buffer holding the same keys. With `ring` 2 (a prefill longer than the ring keeps), the ring
// is read before this forward's writes (its committed slots) and the window's keys and values come
// from kn/vn [B, T, Kv, H] instead; otherwise kn/vn are not read (they may be empty).
// Reading the buffers after XLA's in-place write (rather than before it) also spares the copy XLA
// would otherwise make of each buffer to keep the read ahead of the write.
// A query's result depends only on the keys it sees, taken in that order (its weight on any other key
// of its item is exactly 0), so a row computes the same bits alone (T = 1, its earlier window tokens
// already in the cache) as inside a window, or inside a prefill bucket. Work (up to TILE queries of one
// row's window on one kv head per item) is split over XLA's intra-op pool when it is large.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#if defined(__x86_64__) && defined(__AVX__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // for unaligned loads
inline v8 load8(const float* p) { return *reinterpret_cast<const v8u*>(p); }

// The 8 lanes of a sum reduced by one fixed tree, ((0+1) + (2+3)) + ((4+5) + (6+7)): every q . k is
// reduced this way, whichever keys it is computed beside.
inline float reduce8(v8 a) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }

// out[i * stride] = scale * (q . k_i) for 8 keys k_i (rows `rows[i]`), H a multiple of 8: eight
// independent chains along h, then each reduced by `reduce8`'s tree (with AVX, all eight at once by
// horizontal adds, which pair the same lanes in the same order).
inline void dots8(const float* q, const float* const* rows, int64_t H, float scale, float* out, int64_t stride) {
  v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
  for (int64_t h = 0; h < H; h += 8) {
    const v8 qv = load8(q + h);
    a0 += qv * load8(rows[0] + h);
    a1 += qv * load8(rows[1] + h);
    a2 += qv * load8(rows[2] + h);
    a3 += qv * load8(rows[3] + h);
    a4 += qv * load8(rows[4] + h);
    a5 += qv * load8(rows[5] + h);
    a6 += qv * load8(rows[6] + h);
    a7 += qv * load8(rows[7] + h);
  }
#if defined(__x86_64__) && defined(__AVX__)
  // hadd(x, y) = [x0+x1, x2+x3, y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7]
  const __m256 t0 = _mm256_hadd_ps((__m256)a0, (__m256)a1), t1 = _mm256_hadd_ps((__m256)a2, (__m256)a3);
  const __m256 t2 = _mm256_hadd_ps((__m256)a4, (__m256)a5), t3 = _mm256_hadd_ps((__m256)a6, (__m256)a7);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [(0+1)+(2+3) of keys 0-3 | (4+5)+(6+7)]
  const __m256 lo = _mm256_permute2f128_ps(u0, u1, 0x20), hi = _mm256_permute2f128_ps(u0, u1, 0x31);
  const v8 sums = (v8)_mm256_add_ps(lo, hi) * scale;
  for (int i = 0; i < 8; ++i) out[i * stride] = sums[i];
#else
  const v8 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
  for (int i = 0; i < 8; ++i) out[i * stride] = reduce8(acc[i]) * scale;
#endif
}

// q . k for H not a multiple of 8: lanes h % 8, reduced by the same tree
inline float dot_any(const float* a, const float* b, int64_t H) {
  v8 acc = {0};
  for (int64_t h = 0; h < H; ++h) acc[h % 8] += a[h] * b[h];
  return reduce8(acc);
}

// s[a] = exp(s[a] - mx) for scores <= mx: Cody-Waite reduction and Cephes' degree-6 polynomial (about
// 1 ulp), 8 at a time in vectors (libm's expf, one at a time, was a third of a window's attention).
// The result depends only on the score, not on its place: the same for every caller.
typedef int32_t v8i __attribute__((vector_size(32)));
inline v8 exp8(v8 x) {
  const v8 lowest = {-87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f};
  x = x < lowest ? lowest : x;  // exp(-87) is still a normal float: 2^e below stays in range
  const v8i e = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, v8i);  // round(x / ln 2), x <= 0
  const v8 f = __builtin_convertvector(e, v8);
  v8 r = x - f * 0.693359375f;
  r = r - f * -2.12194440e-4f;
  v8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const v8 y = p * r * r + r + 1.f;
  return (v8)((v8i)y + e * (1 << 23));
}
inline void exp_shifted(float* s, int64_t n, float mx) {
  int64_t a = 0;
  for (; a + 8 <= n; a += 8) {
    v8 x = load8(s + a) - mx;
    const v8 y = exp8(x);
    std::memcpy(s + a, &y, sizeof(y));
  }
  if (a < n) {  // the tail through the same vector code, padded with mx (exp(0))
    float buf[8];
    for (int l = 0; l < 8; ++l) buf[l] = a + l < n ? s[a + l] : mx;
    const v8 y = exp8(load8(buf) - mx);
    for (int l = 0; a + l < n; ++l) s[a + l] = y[l];
  }
}

// o_q[h0 .. h0 + 32) = sum over the keys, ascending, of p_q[a] * v[a], for NQ queries at once (the
// heads of a row that share a kv head), so that each value row is read once for all of them (12
// accumulators at NQ = 3). p_q: the query's normalized weights (stride n; 0 for a key it does not
// see, which adds exactly nothing), o_q: its output (stride H). Key a's value row starts at vrows[a].
template <int NQ>
inline void pv_n(const float* p, int64_t n, const float* const* vrows, int64_t h0, float* o, int64_t H) {
  v8 acc[NQ][4];
  for (int g = 0; g < NQ; ++g) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = (v8){0};
  for (int64_t a = 0; a < n; ++a) {
    const float* vr = vrows[a] + h0;
    if (a + 6 < n) __builtin_prefetch(vrows[a + 6] + h0);  // rows a stride apart: ahead of the prefetcher
    const v8 v0 = load8(vr), v1 = load8(vr + 8), v2 = load8(vr + 16), v3 = load8(vr + 24);
    for (int g = 0; g < NQ; ++g) {
      const float pg = p[g * n + a];
      acc[g][0] += pg * v0;
      acc[g][1] += pg * v1;
      acc[g][2] += pg * v2;
      acc[g][3] += pg * v3;
    }
  }
  for (int g = 0; g < NQ; ++g)
    for (int l = 0; l < 4; ++l) std::memcpy(o + g * H + h0 + 8 * l, &acc[g][l], sizeof(v8));
}

// queries of a row's window per work item: a prefill bucket's window is split into tiles (over the
// threads, and with scratch of TILE x G x keys), a decode or verify window is one
constexpr int64_t TILE = 64;

struct Scratch {
  std::vector<float> sc;        // scores, then weights: [T * G, n]
  std::vector<uint8_t> seen;    // [T, n]
  std::vector<const float*> kr, vr;  // key a's key and value rows (of kv head c), [n] each
};

struct AttendWork {
  const float *q, *k, *v, *kn, *vn;
  const uint8_t* mask;
  const int32_t *lo, *hi;
  float* out;
  int64_t B, T, S, C, G, H;
  int ring;  // 0: a full buffer; 1: a ring of S entries (slot s at entry s % S); 2: a ring, the window from kn/vn
  float scale;
  std::atomic<int64_t> next{0}, done{0};

  int64_t tiles = 1;  // query tiles a row's window is split into (TILE queries each)

  // item = (b, c, tile): the tile's queries of row b's window on kv head c (rows t0 .. t1 - 1 x G heads),
  // over the union of the keys they see, each key row read once for all of them. A query's weight on a
  // key it does not see is exactly 0 (and adds exactly nothing), so its sums are those over its own
  // keys, in the same order, whichever tile and union it is computed in.
  void item(int64_t it, Scratch& w) {
    const int64_t tile = it % tiles, c = (it / tiles) % C, b = it / (tiles * C);
    const int64_t t0 = tile * TILE, t1 = std::min(T, t0 + TILE), TQ = t1 - t0;
    const int64_t w0 = ring ? std::max<int64_t>(hi[b], 0) : std::clamp<int64_t>(hi[b], 0, S - T);  // the window's first slot
    int64_t s0 = w0, jn = 0;  // the committed keys from s0; the window's first jn slots
    for (int64_t t = t0; t < t1; ++t) {
      s0 = std::min(s0, std::clamp<int64_t>(lo[b * T + t], 0, w0));
      for (int64_t j = T - 1; j >= jn; --j)
        if (mask[(b * T + t) * T + j]) {
          jn = j + 1;
          break;
        }
    }
    const int64_t nc = w0 - s0, n = nc + jn, Q = TQ * G;
    const int64_t kv_row = C * H;  // floats between a buffer's consecutive slots
    w.sc.resize(static_cast<size_t>(Q * n));
    w.seen.resize(static_cast<size_t>(TQ * n));
    w.kr.resize(static_cast<size_t>(n));
    w.vr.resize(static_cast<size_t>(n));
    for (int64_t a = 0; a < n; ++a) {  // key a: slot s0 + a (the committed, then the window)
      if (ring == 2 && a >= nc) {  // window key a - nc, from this forward's own
        const int64_t at = ((b * T + a - nc) * C + c) * H;
        w.kr[a] = kn + at;
        w.vr[a] = vn + at;
        continue;
      }
      const int64_t at = (b * S + (ring ? (s0 + a) % S : s0 + a)) * kv_row + c * H;
      w.kr[a] = k + at;
      w.vr[a] = v + at;
    }
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t from = std::clamp<int64_t>(lo[b * T + t], 0, w0) - s0;
      uint8_t* sn = w.seen.data() + (t - t0) * n;
      for (int64_t a = 0; a < nc; ++a) sn[a] = a >= from;
      for (int64_t j = 0; j < jn; ++j) sn[nc + j] = mask[(b * T + t) * T + j] != 0;
    }
    // scores: 8 keys at a time for each query (the last group padded with the first key, unused)
    for (int64_t a0 = 0; a0 < n; a0 += 8) {
      const float* rows[8];
      for (int i = 0; i < 8; ++i) rows[i] = w.kr[a0 + i < n ? a0 + i : a0];
      const int64_t m8 = std::min<int64_t>(8, n - a0);
      for (int64_t qi = 0; qi < Q; ++qi) {
        const int64_t t = t0 + qi / G, g = qi % G;
        const float* qv = q + (((b * T + t) * C + c) * G + g) * H;
        float* sq = w.sc.data() + qi * n;
        if (H % 8 != 0) {
          for (int64_t i = 0; i < m8; ++i) sq[a0 + i] = dot_any(qv, rows[i], H) * scale;
        } else if (m8 == 8) {
          dots8(qv, rows, H, scale, sq + a0, 1);
        } else {
          float tmp[8];
          dots8(qv, rows, H, scale, tmp, 1);
          for (int64_t i = 0; i < m8; ++i) sq[a0 + i] = tmp[i];
        }
      }
    }
    // softmax over the keys each query sees
    for (int64_t t = 0; t < TQ; ++t) {
      const uint8_t* sn = w.seen.data() + t * n;
      bool any = false;
      for (int64_t a = 0; a < n; ++a) any |= sn[a] != 0;
      for (int64_t g = 0; g < G; ++g) {
        float* s = w.sc.data() + (t * G + g) * n;
        if (!any) {  // a query that sees nothing (a padding row): zeros
          std::fill(s, s + n, 0.f);
          continue;
        }
        float mx = -INFINITY;
        for (int64_t a = 0; a < n; ++a)
          if (sn[a]) mx = std::max(mx, s[a]);
        exp_shifted(s, n, mx);
        float sum = 0.f;
        for (int64_t a = 0; a < n; ++a) {
          s[a] = sn[a] ? s[a] : 0.f;
          sum += s[a];
        }
        const float inv = 1.f / sum;
        for (int64_t a = 0; a < n; ++a) s[a] *= inv;
      }
    }
    // outputs: 32 columns of a row's heads at a time (up to 4)
    for (int64_t t = 0; t < TQ; ++t) {
      float* ot = out + ((b * T + t0 + t) * C + c) * G * H;
      int64_t h0 = 0;
      for (; h0 + 32 <= H; h0 += 32)
        for (int64_t g = 0; g < G; g += 4) {
          const float* p = w.sc.data() + (t * G + g) * n;
          switch (std::min<int64_t>(4, G - g)) {
            case 1: pv_n<1>(p, n, w.vr.data(), h0, ot + g * H, H); break;
            case 2: pv_n<2>(p, n, w.vr.data(), h0, ot + g * H, H); break;
            case 3: pv_n<3>(p, n, w.vr.data(), h0, ot + g * H, H); break;
            default: pv_n<4>(p, n, w.vr.data(), h0, ot + g * H, H);
          }
        }
      if (h0 < H)  // the last H % 32 columns
        for (int64_t g = 0; g < G; ++g) {
          float* o = ot + g * H;
          std::fill(o + h0, o + H, 0.f);
          for (int64_t a = 0; a < n; ++a) {
            const float pa = w.sc[(t * G + g) * n + a];
            const float* vr = w.vr[a];
            for (int64_t h = h0; h < H; ++h) o[h] += pa * vr[h];
          }
        }
    }
  }

  void run() {
    Scratch w;
    const int64_t items = B * C * tiles;
    for (int64_t it; (it = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      item(it, w);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                  ffi::Buffer<ffi::F32> kn, ffi::Buffer<ffi::F32> vn, ffi::Buffer<ffi::U8> mask,
                  ffi::Buffer<ffi::S32> lo, ffi::Buffer<ffi::S32> hi, ffi::ResultBuffer<ffi::F32> out, float scale,
                  int32_t ring) {
  auto qd = q.dimensions(), kd = k.dimensions(), md = mask.dimensions();
  const char* usage =
      "specjax_attend: needs q [B, T, Kv, G, H], k/v [B, S, Kv, H] with S >= T, mask uint8 [B, T, T], "
      "lo int32 [B, T], hi int32 [B] and out [B, T, Kv, G, H] (fp32)";
  if (qd.size() != 5 || kd.size() != 4 || md.size() != 3 || v.element_count() != k.element_count() ||
      out->element_count() != q.element_count())
    return ffi::Error::InvalidArgument(usage);
  int64_t B = qd[0], T = qd[1], C = qd[2], G = qd[3], H = qd[4], S = kd[1];
  if (kd[0] != B || (ring != 2 && kd[1] < T) || kd[2] != C || kd[3] != H || md[0] != B || md[1] != T || md[2] != T ||
      lo.element_count() != B * T || hi.element_count() != B)
    return ffi::Error::InvalidArgument(usage);
  if (ring == 2 && (kn.element_count() != B * T * C * H || vn.element_count() != B * T * C * H))
    return ffi::Error::InvalidArgument("specjax_attend: ring=2 reads the window from kn/vn [B, T, Kv, H]");
  auto work = std::make_shared<AttendWork>();
  work->q = q.typed_data();
  work->k = k.typed_data();
  work->v = v.typed_data();
  work->kn = kn.typed_data();
  work->vn = vn.typed_data();
  work->mask = mask.typed_data();
  work->lo = lo.typed_data();
  work->hi = hi.typed_data();
  work->out = out->typed_data();
  work->B = B, work->T = T, work->S = S, work->C = C, work->G = G, work->H = H;
  work->scale = scale;
  work->ring = ring;
  work->tiles = (T + TILE - 1) / TILE;
  const int64_t items = B * C * work->tiles;
  if (items == 0 || T == 0) return ffi::Error::Success();
  // another thread pays from ~2M multiply-adds (q . k and p . v over the keys the queries see): waking
  // one costs tens of microseconds, and the caller waits for the item it took
  const int32_t* lod = lo.typed_data();
  const int32_t* hid = hi.typed_data();
  int64_t keys = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) keys += std::max<int64_t>(0, int64_t(hid[b]) - lod[b * T + t]) + T;
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t helpers = keys * C * G * H * 2 < (int64_t(2) << 20) ? 0 : std::min(threads, items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->run(); });
  work->run();
  while (work->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_attend, Attend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("ring"));

// specjax_residual: out = x + y, elementwise (fp32), for a block's residual add. As its own call, its
// operands and its result are materialized buffers: XLA:CPU can neither contract a product that ends
// a branch (Gemma's post-norms) into the add as one fused multiply-add, nor recompute the residual
// stream inside later fusions, both of which it did for some window widths and not for others.
static ffi::Error Residual(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> out) {
  const int64_t n = x.element_count();
  if (y.element_count() != n || out->element_count() != n)
    return ffi::Error::InvalidArgument("specjax_residual: x, y and out must have the same number of elements");
  const float* a = x.typed_data();
  const float* b = y.typed_data();
  float* o = out->typed_data();
  for (int64_t i = 0; i < n; ++i) o[i] = a[i] + b[i];
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_residual, Residual,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
