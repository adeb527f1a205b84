// specjax_qdense_nk: y[M, N] = x[M, K] . W[N, K]^T in fp32 where W is a GGUF tensor kept as its
// quantized blocks (uint8 [N, K / block * bytes]). Compiled in one translation unit after
// dense_nk.cc (`specjax.models.kernels`), whose reduction code it reuses.
//
// Each block of NB weight rows is taken a chunk of at most ~640 weights at a time: the chunk is
// dequantized once into a small fp32 scratch that stays in L1 (16 weights per vector instruction
// sequence with AVX-512, `dequant_chunk`), then multiplied with all M rows of x in dense_nk's
// register tiles. The dequantization does the fp32 operations gguf.quants does, in its order (one
// product, or a product and one add, per weight; an empty asm between them keeps the compiler from
// fusing them into an FMA, and the function is compiled with fp-contract=off), so the rebuilt
// weights are gguf's bit for bit. The sums run in dense_nk's order (per lane along k, the same
// reduction tree): the product equals dense_nk on the dequantized weight bit for bit, for any row
// count, and a row computes the same alone as in a window. Without AVX-512, Q4_0, Q4_1 and Q8_0 are
// rebuilt 8 weights at a time with AVX2: in registers for up to 3 rows (`fused8_rows`), else into the
// same chunks; other types by the scalar `dequant_block`.
#include <cstring>
#if defined(__x86_64__) && (defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__))
#include <immintrin.h>
#endif

namespace {

enum QType : int32_t { Q4_0 = 0, Q4_1 = 1, Q5_0 = 2, Q5_1 = 3, Q8_0 = 4, Q4_K = 5, Q5_K = 6, Q6_K = 7 };

// IEEE half (little-endian bytes) to float, exactly (with F16C, one instruction)
inline float f16(const uint8_t* p) {
  uint32_t h = uint32_t(p[0]) | (uint32_t(p[1]) << 8);
#if defined(__x86_64__) && defined(__F16C__)
  return _cvtsh_ss(static_cast<unsigned short>(h));
#endif
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

// acc[i][j] (+)= x[m0 + i, k0:k1] . s[j, 0:k1-k0] for MT rows of x, where s holds NB dequantized weight
// rows of a chunk (row stride kc): dense_nk's `tile`, the weights read from the scratch
template <int MT>
inline void qtile(const float* __restrict x, const float* __restrict s, vf* __restrict acc, int64_t K, int64_t kc,
                  int64_t m0, int64_t k0, int64_t k1, bool first) {
  vf a[MT][NB];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) a[i][j] = first ? (vf){} : acc[(m0 + i) * NB + j];
  for (int64_t k = k0; k < k1; k += VW) {
    vf xv[MT];
    for (int i = 0; i < MT; ++i) xv[i] = load(x + (m0 + i) * K + k);
    for (int j = 0; j < NB; ++j) {
      vf wv = load(s + j * kc + (k - k0));
      pin(wv);
      for (int i = 0; i < MT; ++i) a[i][j] += xv[i] * wv;
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) acc[(m0 + i) * NB + j] = a[i][j];
}

// The scratch path: weight rows [n, n + NB), for each chunk of cb blocks (kc weights) dequantized by
// `deq(row, b0, b1, out)` into `scratch`, times every row of x in tiles of at most MT_MAX rows (sizes
// balanced as dense_nk's), then reduced into y.
template <class Deq>
void scratch_rows(const float* x, const uint8_t* w, float* y, vf* acc, float* scratch, Deq deq, int64_t M,
                  int64_t K, int64_t N, int64_t n, int64_t rb, int64_t nb, int64_t cb, int bw) {
  const int64_t kc = cb * bw, tiles = (M + MT_MAX - 1) / MT_MAX;
  for (int64_t b0 = 0; b0 < nb; b0 += cb) {
    const int64_t b1 = std::min(b0 + cb, nb), k0 = b0 * bw, k1 = b1 * bw;
    for (int j = 0; j < NB; ++j) deq(w + (n + j) * rb, b0, b1, scratch + j * kc);
    for (int64_t t = 0, m = 0; t < tiles; ++t) {
      int64_t mt = (M - m + (tiles - t) - 1) / (tiles - t);
      if (mt == 3) qtile<3>(x, scratch, acc, K, kc, m, k0, k1, b0 == 0);
      else if (mt == 2) qtile<2>(x, scratch, acc, K, kc, m, k0, k1, b0 == 0);
      else qtile<1>(x, scratch, acc, K, kc, m, k0, k1, b0 == 0);
      m += mt;
    }
  }
  for (int64_t m = 0; m < M; ++m) reduce_nb(acc + m * NB, y + m * N + n);
}

// one weight row (the last N % NB) into scratch and dotted with each row of x, as dense_nk's remainder
template <class Deq>
void single_row(const float* x, const uint8_t* row, float* y, float* scratch, Deq deq, int64_t M, int64_t K,
                int64_t N, int64_t n, int64_t nb) {
  deq(row, 0, nb, scratch);
  for (int64_t m = 0; m < M; ++m) {
    vf a = (vf){};
    for (int64_t k = 0; k < K; k += VW) a += load(x + m * K + k) * load(scratch + k);
    float s = 0.f;
    for (int i = 0; i < VW; ++i) s += a[i];
    y[m * N + n] = s;
  }
}

#if defined(__x86_64__) && defined(__AVX512F__)
// With AVX-512, 32 weights (a block, or a group of a K-quant super-block) at a time into two vectors:
// `Deq<T>::get(row, g, lo, hi)` rebuilds weights [32 g, 32 g + 32) of a row. `keep` is dense_nk's
// `pin`: a product kept in a register before its add cannot be contracted into an FMA (gguf rounds the
// product, then the sum).
inline void keep(__m512& v) { asm("" : "+v"(v)); }
inline __m512 bcast_f16(const uint8_t* p) {  // exact: fp16 -> fp32 loses nothing
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(h)));
}
inline __m512i bytes16(const uint8_t* p) {  // 16 bytes, zero-extended to 16 int32
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512 mul(__m512 d, __m512i q) { return _mm512_mul_ps(d, _mm512_cvtepi32_ps(q)); }
inline __m512 mul_add(__m512 d, __m512i q, __m512 m) {  // d * float(q) + m, two roundings
  __m512 p = mul(d, q);
  keep(p);
  return _mm512_add_ps(p, m);
}
inline __m512 mul_sub(__m512 d, __m512i q, __m512 m) {  // d * float(q) - m, two roundings
  __m512 p = mul(d, q);
  keep(p);
  return _mm512_sub_ps(p, m);
}
inline void nibbles(const uint8_t* qs, __m512i& lo, __m512i& hi) {  // bytes j: lo = q & 15, hi = q >> 4
  __m512i v = bytes16(qs);
  lo = _mm512_and_si512(v, _mm512_set1_epi32(0xF));
  hi = _mm512_srli_epi32(v, 4);
}
inline void fifth_bit(uint32_t qh, __m512i& lo, __m512i& hi) {  // bit j of qh -> 16 in lo[j], bit 16 + j in hi[j]
  const __m512i sixteen = _mm512_set1_epi32(16);
  lo = _mm512_mask_or_epi32(lo, static_cast<__mmask16>(qh), lo, sixteen);
  hi = _mm512_mask_or_epi32(hi, static_cast<__mmask16>(qh >> 16), hi, sixteen);
}

template <int T>
struct Deq;
template <>
struct Deq<Q4_0> {  // d * (q - 8)
  static void get(const uint8_t* row, int64_t g, __m512& a, __m512& b) {
    const uint8_t* p = row + g * 18;
    const __m512 d = bcast_f16(p);
    const __m512i off = _mm512_set1_epi32(8);
    __m512i lo, hi;
    nibbles(p + 2, lo, hi);
    a = mul(d, _mm512_sub_epi32(lo, off));
    b = mul(d, _mm512_sub_epi32(hi, off));
  }
};
template <>
struct Deq<Q4_1> {  // d * q + m
  static void get(const uint8_t* row, int64_t g, __m512& a, __m512& b) {
    const uint8_t* p = row + g * 20;
    const __m512 d = bcast_f16(p), m = bcast_f16(p + 2);
    __m512i lo, hi;
    nibbles(p + 4, lo, hi);
    a = mul_add(d, lo, m);
    b = mul_add(d, hi, m);
  }
};
template <>
struct Deq<Q5_0> {  // d * (q - 16), q's 5th bits in qh
  static void get(const uint8_t* row, int64_t g, __m512& a, __m512& b) {
    const uint8_t* p = row + g * 22;
    const __m512 d = bcast_f16(p);
    const __m512i off = _mm512_set1_epi32(16);
    __m512i lo, hi;
    nibbles(p + 6, lo, hi);
    fifth_bit(u32(p + 2), lo, hi);
    a = mul(d, _mm512_sub_epi32(lo, off));
    b = mul(d, _mm512_sub_epi32(hi, off));
  }
};
template <>
struct Deq<Q5_1> {  // d * q + m, q's 5th bits in qh
  static void get(const uint8_t* row, int64_t g, __m512& a, __m512& b) {
    const uint8_t* p = row + g * 24;
    const __m512 d = bcast_f16(p), m = bcast_f16(p + 2);
    __m512i lo, hi;
    nibbles(p + 8, lo, hi);
    fifth_bit(u32(p + 4), lo, hi);
    a = mul_add(d, lo, m);
    b = mul_add(d, hi, m);
  }
};
template <>
struct Deq<Q8_0> {  // float(q) * d
  static void get(const uint8_t* row, int64_t g, __m512& a, __m512& b) {
    const uint8_t* p = row + g * 34;
    const __m512 d = bcast_f16(p);
    a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2)))), d);
    b = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 18)))), d);
  }
};
template <int T>
struct DeqK {  // Q4_K / Q5_K group s of super-block g / 8: (d * sc) * q - dmin * m
  static void get(const uint8_t* row, int64_t g, __m512& a, __m512& b) {
    const uint8_t* p = row + (g / 8) * (T == Q4_K ? 144 : 176);
    const int s = int(g % 8);
    int sc, mn;
    scale_min_k4(p + 4, s, sc, mn);
    const __m512 ds = _mm512_set1_ps(f16(p) * float(sc)), dm = _mm512_set1_ps(f16(p + 2) * float(mn));
    const uint8_t* q = (T == Q4_K ? p + 16 : p + 48) + (s / 2) * 32;
    const __m512i lo4 = _mm512_set1_epi32(0xF);
    __m512i v0 = _mm512_and_si512(_mm512_srli_epi32(bytes16(q), (s & 1) * 4), lo4);
    __m512i v1 = _mm512_and_si512(_mm512_srli_epi32(bytes16(q + 16), (s & 1) * 4), lo4);
    if (T == Q5_K) {
      const __m512i one = _mm512_set1_epi32(1);
      v0 = _mm512_or_si512(v0, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(bytes16(p + 16), s), one), 4));
      v1 = _mm512_or_si512(v1, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(bytes16(p + 32), s), one), 4));
    }
    a = mul_sub(ds, v0, dm);
    b = mul_sub(ds, v1, dm);
  }
};
template <>
struct Deq<Q4_K> : DeqK<Q4_K> {};
template <>
struct Deq<Q5_K> : DeqK<Q5_K> {};
template <>
struct Deq<Q6_K> {  // (d * sc) * (q - 32) per group of 16
  static __m512 sixteen(const uint8_t* p, int r) {  // weights r .. r + 15 of the super-block at p
    const int h = r / 128, l = r % 128;
    const __m512i nib = _mm512_and_si512(_mm512_srli_epi32(bytes16(p + h * 64 + l % 64), 4 * (l / 64)), _mm512_set1_epi32(0xF));
    const __m512i hb = _mm512_and_si512(_mm512_srli_epi32(bytes16(p + 128 + h * 32 + l % 32), 2 * (l / 32)), _mm512_set1_epi32(3));
    const __m512i q = _mm512_sub_epi32(_mm512_or_si512(nib, _mm512_slli_epi32(hb, 4)), _mm512_set1_epi32(32));
    const float ds = f16(p + 208) * float(reinterpret_cast<const int8_t*>(p + 192)[r / 16]);
    return mul(_mm512_set1_ps(ds), q);
  }
  static void get(const uint8_t* row, int64_t g, __m512& a, __m512& b) {
    const uint8_t* p = row + (g / 8) * 210;
    const int r = int(g % 8) * 32;
    a = sixteen(p, r);
    b = sixteen(p, r + 16);
  }
};

// blocks [b0, b1) of a row into out (the scratch path's dequantization)
template <int T>
struct DeqRange {
  void operator()(const uint8_t* row, int64_t b0, int64_t b1, float* out) const {
    const int per = block_weights(T) / 32;
    for (int64_t g = b0 * per; g < b1 * per; ++g, out += 32) {
      __m512 a, b;
      Deq<T>::get(row, g, a, b);
      _mm512_storeu_ps(out, a);
      _mm512_storeu_ps(out + 16, b);
    }
  }
};

// The fused path, for M <= MT_MAX (one tile: plain decoding and small windows): weight rows [n, n + NB)
// rebuilt 32 weights at a time in registers and multiplied at once, no scratch. Each accumulator gets
// the same products in the same order as in the scratch path: the same bits.
template <int T, int MT>
void fused_rows(const float* __restrict x, const uint8_t* __restrict w, float* __restrict y, int64_t K, int64_t N,
                int64_t n, int64_t rb) {
  vf a[MT][NB];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) a[i][j] = (vf){};
  const uint8_t* wr = w + n * rb;
  for (int64_t g = 0; g < K / 32; ++g) {
    vf x0[MT], x1[MT];
    for (int i = 0; i < MT; ++i) {
      x0[i] = load(x + i * K + 32 * g);
      x1[i] = load(x + i * K + 32 * g + 16);
    }
    for (int j = 0; j < NB; ++j) {
      __m512 lo, hi;
      Deq<T>::get(wr + j * rb, g, lo, hi);
      vf l = (vf)lo, h = (vf)hi;
      for (int i = 0; i < MT; ++i) a[i][j] += x0[i] * l;
      for (int i = 0; i < MT; ++i) a[i][j] += x1[i] * h;
    }
  }
  for (int i = 0; i < MT; ++i) reduce_nb(a[i], y + i * N + n);
}

template <int T>
void typed_rows(const float* x, const uint8_t* w, float* y, vf* acc, float* scratch, int64_t M, int64_t K,
                int64_t N, int64_t n0, int64_t n1, int64_t rb, int64_t nb, int64_t cb) {
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    if (M == 1) fused_rows<T, 1>(x, w, y, K, N, n, rb);
    else if (M == 2) fused_rows<T, 2>(x, w, y, K, N, n, rb);
    else if (M == 3) fused_rows<T, 3>(x, w, y, K, N, n, rb);
    else scratch_rows(x, w, y, acc, scratch, DeqRange<T>{}, M, K, N, n, rb, nb, cb, block_weights(T));
  }
  for (; n < n1; ++n) single_row(x, w + n * rb, y, scratch, DeqRange<T>{}, M, K, N, n, nb);
}
#endif

// without AVX-512: the scalar `dequant_block`, through the scratch path for every row count
struct ScalarDeq {
  int32_t type;
  void operator()(const uint8_t* row, int64_t b0, int64_t b1, float* out) const {
    const int bw = block_weights(type), bb = block_bytes(type);
    for (int64_t i = b0; i < b1; ++i) dequant_block(type, row + i * bb, out + (i - b0) * bw);
  }
};

#if defined(__x86_64__) && defined(__AVX2__) && !defined(__AVX512F__)
// With AVX2 (no AVX-512), the common 32-weight types 8 weights per instruction into the scratch: the
// scalar `dequant_block` cost ~3 cycles a weight, 5x the fp32 product it feeds (Zen 2, one row). The
// same operations as gguf's, in its order (`keep8`: a product is rounded before its add).
inline void keep8(__m256& v) { asm("" : "+x"(v)); }
inline __m256i bytes8(const uint8_t* p) {  // 8 bytes, zero-extended to 8 int32
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
template <int T>
struct Deq8Range {
  void operator()(const uint8_t* row, int64_t b0, int64_t b1, float* out) const {
    const __m256i low = _mm256_set1_epi32(0xF), eight = _mm256_set1_epi32(8);
    for (int64_t i = b0; i < b1; ++i, out += 32) {
      const uint8_t* p = row + i * block_bytes(T);
      const __m256 d = _mm256_set1_ps(f16(p));
      if (T == Q8_0) {  // float(q) * d
        for (int h = 0; h < 4; ++h) {
          __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 2 + 8 * h)));
          _mm256_storeu_ps(out + 8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
        }
        continue;
      }
      const uint8_t* qs = p + (T == Q4_1 ? 4 : 2);
      for (int h = 0; h < 2; ++h) {  // bytes 8h..8h+7: low nibbles are weights 8h.., high ones 16 + 8h..
        const __m256i v = bytes8(qs + 8 * h);
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_srli_epi32(v, 4);
        if (T == Q4_0) {  // d * (q - 8)
          _mm256_storeu_ps(out + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(lo, eight))));
          _mm256_storeu_ps(out + 16 + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(hi, eight))));
        } else {  // Q4_1: d * q + m, two roundings
          const __m256 m = _mm256_set1_ps(f16(p + 2));
          __m256 a = _mm256_mul_ps(d, _mm256_cvtepi32_ps(lo)), b = _mm256_mul_ps(d, _mm256_cvtepi32_ps(hi));
          keep8(a);
          keep8(b);
          _mm256_storeu_ps(out + 8 * h, _mm256_add_ps(a, m));
          _mm256_storeu_ps(out + 16 + 8 * h, _mm256_add_ps(b, m));
        }
      }
    }
  }
};
#endif

// weight rows [n, n1) through the scratch path, a chunk of weight rows dequantized by `deq`
template <class Deq>
void deq_rows(const float* x, const uint8_t* w, float* y, vf* acc, float* scratch, Deq deq, int64_t M, int64_t K,
              int64_t N, int64_t n, int64_t n1, int64_t rb, int64_t nb, int64_t cb, int bw) {
  for (; n + NB <= n1; n += NB) scratch_rows(x, w, y, acc, scratch, deq, M, K, N, n, rb, nb, cb, bw);
  for (; n < n1; ++n) single_row(x, w + n * rb, y, scratch, deq, M, K, N, n, nb);
}

#if defined(__x86_64__) && defined(__AVX2__) && !defined(__AVX512F__)
// Weights 8h .. 8h + 7 of the block at p (Q4_0, Q4_1, Q8_0), as `Deq8Range` rebuilds them; v0, v1: the
// block's nibble bytes 0-7 and 8-15 zero-extended (4-bit types), d and m its scale and minimum.
template <int T>
inline __m256 deq8(const uint8_t* p, int h, __m256i v0, __m256i v1, __m256 d, __m256 m) {
  if (T == Q8_0) {  // float(q) * d
    __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 2 + 8 * h)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(q), d);
  }
  const __m256i v = (h & 1) ? v1 : v0;  // weights 0-15: low nibbles; 16-31: high ones
  const __m256i q = h < 2 ? _mm256_and_si256(v, _mm256_set1_epi32(0xF)) : _mm256_srli_epi32(v, 4);
  if (T == Q4_0) return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(8))));
  __m256 a = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q));  // Q4_1: d * q + m, two roundings
  keep8(a);
  return _mm256_add_ps(a, m);
}

// The fused path, for M <= MT_MAX rows (plain decoding and small windows): weight rows [n, n + NB)
// rebuilt 8 weights at a time in registers and multiplied at once, without the scratch's store and
// reload. Each accumulator gets the same products in the same order as in the scratch path (k
// ascending, 8 at a time): the same bits.
template <int T, int MT>
void fused8_rows(const float* __restrict x, const uint8_t* __restrict w, float* __restrict y, int64_t K, int64_t N,
                 int64_t n, int64_t rb) {
  vf a[MT][NB];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) a[i][j] = (vf){};
  const uint8_t* wr = w + n * rb;
  constexpr int bb = T == Q8_0 ? 34 : T == Q4_1 ? 20 : 18;
  for (int64_t g = 0; g < K / 32; ++g) {
    for (int j = 0; j < NB; ++j) {
      const uint8_t* p = wr + j * rb + g * bb;
      const __m256 d = _mm256_set1_ps(f16(p));
      const __m256 m = T == Q4_1 ? _mm256_set1_ps(f16(p + 2)) : d;
      const uint8_t* qs = p + (T == Q4_1 ? 4 : 2);
      const __m256i v0 = T == Q8_0 ? _mm256_setzero_si256() : bytes8(qs);
      const __m256i v1 = T == Q8_0 ? _mm256_setzero_si256() : bytes8(qs + 8);
      for (int h = 0; h < 4; ++h) {
        vf wv = (vf)deq8<T>(p, h, v0, v1, d, m);
        pin(wv);
        for (int i = 0; i < MT; ++i) a[i][j] += load(x + i * K + 32 * g + 8 * h) * wv;
      }
    }
  }
  for (int i = 0; i < MT; ++i) reduce_nb(a[i], y + i * N + n);
}

// weight rows [n0, n1): the fused path for up to MT_MAX rows of x, else the scratch path
template <int T>
void typed8_rows(const float* x, const uint8_t* w, float* y, vf* acc, float* scratch, int64_t M, int64_t K,
                 int64_t N, int64_t n0, int64_t n1, int64_t rb, int64_t nb, int64_t cb) {
  if (M > MT_MAX) return deq_rows(x, w, y, acc, scratch, Deq8Range<T>{}, M, K, N, n0, n1, rb, nb, cb, 32);
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    if (M == 1) fused8_rows<T, 1>(x, w, y, K, N, n, rb);
    else if (M == 2) fused8_rows<T, 2>(x, w, y, K, N, n, rb);
    else fused8_rows<T, 3>(x, w, y, K, N, n, rb);
  }
  for (; n < n1; ++n) single_row(x, w + n * rb, y, scratch, Deq8Range<T>{}, M, K, N, n, nb);
}
#endif

// weight rows [n0, n1) of the packed weight. K is a multiple of 32, so there is no tail of k. Chunks
// of whole blocks, at most ~640 weights (NB rows of a chunk: <= 20 KiB, in L1 with x).
void qweight_rows(const float* x, const uint8_t* w, float* y, int32_t type, int64_t M, int64_t K, int64_t N,
                  int64_t n0, int64_t n1) {
  const int bw = block_weights(type);
  const int64_t rb = K / bw * block_bytes(type), nb = K / bw;
  const int64_t chunks = std::max<int64_t>(1, (K + 639) / 640);
  const int64_t cb = (nb + chunks - 1) / chunks, kc = cb * bw;
  std::unique_ptr<vf[]> acc(new vf[M * NB]);
  std::unique_ptr<vf[]> buf(new vf[(std::max(NB * kc, K) + VW - 1) / VW]);
  float* scratch = reinterpret_cast<float*>(buf.get());
#if defined(__x86_64__) && defined(__AVX512F__)
  switch (type) {
#define SPECJAX_TYPED(T) \
  case T: return typed_rows<T>(x, w, y, acc.get(), scratch, M, K, N, n0, n1, rb, nb, cb);
    SPECJAX_TYPED(Q4_0) SPECJAX_TYPED(Q4_1) SPECJAX_TYPED(Q5_0) SPECJAX_TYPED(Q5_1)
    SPECJAX_TYPED(Q8_0) SPECJAX_TYPED(Q4_K) SPECJAX_TYPED(Q5_K) SPECJAX_TYPED(Q6_K)
#undef SPECJAX_TYPED
  }
#endif
#if defined(__x86_64__) && defined(__AVX2__) && !defined(__AVX512F__)
  switch (type) {
    case Q4_0: return typed8_rows<Q4_0>(x, w, y, acc.get(), scratch, M, K, N, n0, n1, rb, nb, cb);
    case Q4_1: return typed8_rows<Q4_1>(x, w, y, acc.get(), scratch, M, K, N, n0, n1, rb, nb, cb);
    case Q8_0: return typed8_rows<Q8_0>(x, w, y, acc.get(), scratch, M, K, N, n0, n1, rb, nb, cb);
  }
#endif
  deq_rows(x, w, y, acc.get(), scratch, ScalarDeq{type}, M, K, N, n0, n1, rb, nb, cb, bw);
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
