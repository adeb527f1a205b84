// specjax_qdense_nk: y[M, N] = x[M, K] . W[N, K]^T in fp32 where W is a GGUF tensor kept as its
// quantized blocks (uint8 [N, K / block * bytes]). Compiled in one translation unit after
// dense_nk.cc (`specjax.models.kernels`), whose tile code it reuses.
//
// Each block of NB weight rows is dequantized once into a small fp32 scratch (the fp32 operations
// gguf.quants does, in its order: one product, or a product and one add, per weight; no FMA merges
// them: `dequant_block` is compiled with fp-contract=off), so the rebuilt weights are gguf's bit for bit; then
// dense_nk's `block` multiplies them with all M rows of x. The sums therefore run in dense_nk's
// order: the product equals dense_nk on the dequantized weight bit for bit, for any row count, and
// a row computes the same alone as in a window.
#include <cstring>

namespace {

enum QType : int32_t { Q4_0 = 0, Q4_1 = 1, Q5_0 = 2, Q5_1 = 3, Q8_0 = 4, Q4_K = 5, Q5_K = 6, Q6_K = 7 };

// IEEE half (little-endian bytes) to float, exactly
inline float f16(const uint8_t* p) {
  uint32_t h = uint32_t(p[0]) | (uint32_t(p[1]) << 8);
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, f;
  if (exp == 0) {
    float v = float(man) * 5.9604644775390625e-8f;  // man * 2^-24: exact for 10-bit man
    return sign ? -v : v;
  }
  f = exp == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((exp + 112) << 23) | (man << 13));
  float out;
  std::memcpy(&out, &f, 4);
  return out;
}

inline uint32_t u32(const uint8_t* p) {
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}

inline void scale_min_k4(const uint8_t* s, int g, int& sc, int& mn) {
  if (g < 4) {
    sc = s[g] & 63;
    mn = s[g + 4] & 63;
  } else {
    sc = (s[g + 4] & 0xF) | ((s[g - 4] >> 6) << 4);
    mn = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
  }
}

// one block (32 or 256 weights) of `type` at b into out. fp-contract=off here only: a product and
// an add stay two roundings, as gguf's numpy does them (the tile's products may use FMAs, as dense_nk's)
__attribute__((noinline, optimize("fp-contract=off"))) void dequant_block(int32_t type, const uint8_t* b, float* out) {
  switch (type) {
    case Q4_0: {
      float d = f16(b);
      for (int j = 0; j < 16; ++j) {
        out[j] = d * float(int(b[2 + j] & 0xF) - 8);
        out[j + 16] = d * float(int(b[2 + j] >> 4) - 8);
      }
      break;
    }
    case Q4_1: {
      float d = f16(b), m = f16(b + 2);
      for (int j = 0; j < 16; ++j) {
        out[j] = d * float(b[4 + j] & 0xF) + m;
        out[j + 16] = d * float(b[4 + j] >> 4) + m;
      }
      break;
    }
    case Q5_0: {
      float d = f16(b);
      uint32_t qh = u32(b + 2);
      for (int j = 0; j < 16; ++j) {
        int lo = (b[6 + j] & 0xF) | (((qh >> j) & 1) << 4), hi = (b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        out[j] = d * float(lo - 16);
        out[j + 16] = d * float(hi - 16);
      }
      break;
    }
    case Q5_1: {
      float d = f16(b), m = f16(b + 2);
      uint32_t qh = u32(b + 4);
      for (int j = 0; j < 16; ++j) {
        int lo = (b[8 + j] & 0xF) | (((qh >> j) & 1) << 4), hi = (b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        out[j] = d * float(lo) + m;
        out[j + 16] = d * float(hi) + m;
      }
      break;
    }
    case Q8_0: {
      float d = f16(b);
      for (int j = 0; j < 32; ++j) out[j] = float(int8_t(b[2 + j])) * d;
      break;
    }
    case Q4_K:
    case Q5_K: {
      float d = f16(b), dmin = f16(b + 2);
      const uint8_t* s = b + 4;
      const uint8_t* qh = b + 16;
      const uint8_t* qs = type == Q4_K ? b + 16 : b + 48;
      for (int g = 0; g < 8; ++g) {
        int sc, mn;
        scale_min_k4(s, g, sc, mn);
        float ds = d * float(sc), dm = dmin * float(mn);
        const uint8_t* q = qs + (g / 2) * 32;
        int shift = (g & 1) * 4;
        for (int l = 0; l < 32; ++l) {
          int v = (q[l] >> shift) & 0xF;
          if (type == Q5_K) v |= ((qh[l] >> g) & 1) << 4;
          out[g * 32 + l] = ds * float(v) - dm;
        }
      }
      break;
    }
    case Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      float d = f16(b + 208);
      float ds[16];
      for (int i = 0; i < 16; ++i) ds[i] = d * float(sc[i]);
      for (int p = 0; p < 256; ++p) {
        int h = p / 128, r = p % 128;
        int nib = (ql[h * 64 + r % 64] >> (4 * (r / 64))) & 0xF;
        int hb = (qh[h * 32 + r % 32] >> (2 * (r / 32))) & 3;
        out[p] = ds[p / 16] * float(int8_t((nib | (hb << 4))) - 32);
      }
      break;
    }
  }
}

inline int block_weights(int32_t type) { return type >= Q4_K ? 256 : 32; }
inline int block_bytes(int32_t type) {
  static const int bytes[] = {18, 20, 22, 24, 34, 144, 176, 210};
  return bytes[type];
}

void dequant_row(int32_t type, const uint8_t* row, float* out, int64_t K) {
  const int bw = block_weights(type), bb = block_bytes(type);
  for (int64_t i = 0; i < K / bw; ++i) dequant_block(type, row + i * bb, out + i * bw);
}

// weight rows [n0, n1) of the packed weight: each block of NB rows dequantized into `scratch`
// (2 * NB * K floats: `block` prefetches the NB rows after the ones it reads), then dense_nk's
// `block`; the last few rows one at a time, as dense_nk's `weight_rows` does them.
void qweight_rows(const float* x, const uint8_t* w, float* y, int32_t type, int64_t M, int64_t K, int64_t N,
                  int64_t n0, int64_t n1) {
  const int64_t rb = K / block_weights(type) * block_bytes(type);
  std::unique_ptr<v16[]> acc(new v16[M * NB]);
  std::unique_ptr<v16[]> buf(new v16[(2 * NB * K + 15) / 16]);
  float* scratch = reinterpret_cast<float*>(buf.get());
  const int64_t K16 = K & ~int64_t(15);
  const int64_t chunks = std::max<int64_t>(1, (K16 + 639) / 640);
  const int64_t kc = std::max<int64_t>(16, (K16 / 16 + chunks - 1) / chunks * 16);
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    for (int j = 0; j < NB; ++j) dequant_row(type, w + (n + j) * rb, scratch + j * K, K);
    // `block` reads rows n .. n+NB-1 of its weight argument: the scratch, seen as starting at row 0
    block(x, scratch - n * K, y, acc.get(), M, K, N, n, kc);
  }
  for (; n < n1; ++n) {
    dequant_row(type, w + n * rb, scratch, K);
    for (int64_t m = 0; m < M; ++m) {
      v16 a = (v16){};
      for (int64_t k = 0; k < K16; k += 16) a += load(x + m * K + k) * load(scratch + k);
      float s = 0.f;
      for (int i = 0; i < 16; ++i) s += a[i];
      for (int64_t k = K16; k < K; ++k) s += x[m * K + k] * scratch[k];
      y[m * N + n] = s;
    }
  }
}

struct QWork {
  const float* x;
  const uint8_t* w;
  float* y;
  int32_t type;
  int64_t M, K, N, block, nblocks;
  std::atomic<int64_t> next{0}, done{0};
  void run() {
    for (int64_t b; (b = next.fetch_add(1, std::memory_order_relaxed)) < nblocks;) {
      int64_t n0 = b * block, n1 = std::min(n0 + block, N);
      qweight_rows(x, w, y, type, M, K, N, n0, n1);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error QDenseNK(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                    ffi::ResultBuffer<ffi::F32> y, int32_t qtype) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (qtype < Q4_0 || qtype > Q6_K) return ffi::Error::InvalidArgument("specjax_qdense_nk: unknown block type code");
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || yd[0] != xd[0] || yd[1] != wd[0] ||
      xd[1] % block_weights(qtype) != 0 || wd[1] != xd[1] / block_weights(qtype) * block_bytes(qtype))
    return ffi::Error::InvalidArgument(
        "specjax_qdense_nk: needs x [M, K] fp32, w uint8 [N, K / block * bytes] and y [M, N] fp32");
  auto work = std::make_shared<QWork>();
  work->x = x.typed_data();
  work->w = w.typed_data();
  work->y = y->typed_data();
  work->type = qtype;
  work->M = xd[0];
  work->K = xd[1];
  work->N = wd[0];
  if (work->M == 0 || work->N == 0) return ffi::Error::Success();
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // the same split as dense_nk's (in weight rows; the sums do not depend on it)
  int64_t block = (work->N + 4 * threads - 1) / (4 * threads);
  block = std::max<int64_t>(block, (1 << 16) / (4 * std::max<int64_t>(work->K, 1)));
  block = std::max<int64_t>(NB, (block + NB - 1) / NB * NB);
  work->block = block;
  work->nblocks = (work->N + block - 1) / block;
  int64_t work_units = work->N * work->K * std::max<int64_t>(8, work->M);
  int64_t helpers = work_units < (int64_t(4) << 19) ? 0 : std::min(threads, work->nblocks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->run(); });
  work->run();
  while (work->done.load(std::memory_order_acquire) < work->nblocks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_qdense_nk, QDenseNK,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("qtype"));
