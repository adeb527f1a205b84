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
//
// Attribute `mode` 1 is the fast mode (`weights_arith="q8"`, below): for the 32-weight types, x rounded
// to int8 per block and integer dots, as llama.cpp computes; K-quant types stay exact.
#include <cmath>
#include <cstring>
#include <type_traits>
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

// ---- fast mode (mode 1): llama.cpp's arithmetic, activations as int8 per 32, integer dots -----------
// x is quantized once per call, each row's blocks of 32 apart: d = amax / 127, q = round-half-even(x / d)
// (as x * (1 / d)), s = sum(q). A weight block of a 32-weight type is unsigned bytes u with an integer
// offset o (Q4_0: nibbles, o = 8; Q5_0: 5 bits, o = 16; Q4_1/Q5_1: o = 0 and a minimum m; Q8_0: q + 128,
// o = 128 with VNNI) and a scale dw, so the block's contribution to an output is
//   dw * dx * (sum(u * q) - o * s)  [+ m * dx * s for Q4_1/Q5_1],
// the integer part exact in int32. The per-lane integer sums are converted and accumulated in fp32
// lanes (as ggml's vec_dot), then summed in a fixed order: every row of x is computed by the same
// operations whatever M is, so a row is the same alone as in a window, and plain decoding and a
// verify window share one arithmetic. K-quant types (256-weight blocks) stay exact in this mode.
inline bool q8_type(int32_t type) { return type <= Q8_0; }

struct XQ {  // x [M, K] quantized per 32: q int8 [M, K]; per block d, d * s, and -o * s
  std::unique_ptr<int8_t[]> q;
  std::unique_ptr<float[]> d, ds;
  std::unique_ptr<int32_t[]> os;
  // for the 512-bit path (two blocks a vector), per row and pair of blocks, 16 lanes: d of each block
  // in its 8 lanes; d * s and -o * s in each block's first lane, 0 elsewhere
  std::unique_ptr<float[]> d16, ds16;
  std::unique_ptr<int32_t[]> os16;
};

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SPECJAX_Q8_512 1
#else
#define SPECJAX_Q8_512 0
#endif

#if SPECJAX_Q8_512 && defined(__AVX2__) && defined(__AVX512VL__) && !defined(SPECJAX_Q8_NO_X16)  // VL: q8_offset(Q8_0)
#define SPECJAX_Q8_X16 1
#else
#define SPECJAX_Q8_X16 0
#endif
// Q4_0, Q4_1 and Q8_0 with AVX-512 VNNI, 16 weight rows at a time, one output per lane (llama.cpp's
// interleaved layout, built in registers from the file's rows instead of repacked at load): each
// block's bytes of the 16 rows are transposed so that lane l of operand j holds weights 4j .. 4j + 3 of
// row l; one vpdpbusd per operand against x's 4 bytes broadcast gives the 16 rows' integer sums at
// once, and the scales (gathered, fp16 -> fp32 exactly) multiply 16 outputs per instruction instead of
// one. Per output the operations are those of a scalar loop over the blocks in order:
//   acc = fma(dw * dx, float(sum(u * q) - o * s), acc)  [acc = fma(mw, dx * s, acc) for Q4_1],
// the same for every row of x whatever M is (a row alone equals itself in a window).

// Measured against the 2-blocks-a-vector tile (`-DSPECJAX_Q8_NO_X16`, A/B in one process, this
// machine): Q4_1 [1536 x 576] streamed from memory 1.05x its time at one row, 0.57x at five; the Q8_0
// LM head [49152 x 576] 0.58x at one row, 0.62x at five. Without the next group's prefetch
// (`-DSPECJAX_Q8_X16_NO_PREFETCH`) the 16 strided streams made one row 1.5x slower.
inline constexpr bool q8_x16_type(int32_t t) { return t == Q4_0 || t == Q4_1 || t == Q8_0; }

// the offset o of a type's unsigned weight bytes, as `q8_unpack` builds them
inline int q8_offset(int32_t type) {
  switch (type) {
    case Q4_0: return 8;
    case Q5_0: return 16;
#if defined(__x86_64__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    case Q8_0: return 128;  // u = q + 128 (dpbusd multiplies unsigned by signed bytes)
#endif
    default: return 0;      // Q4_1, Q5_1; Q8_0 without VNNI (signed dot)
  }
}

void q8_quantize(const float* x, int64_t M, int64_t K, int32_t type, XQ& out) {
  const int64_t G = K / 32;
  out.q.reset(new int8_t[M * K]);
  out.d.reset(new float[M * G]);
  out.ds.reset(new float[M * G]);
  out.os.reset(new int32_t[M * G]);
  const int o = q8_offset(type);
  for (int64_t b = 0; b < M * G; ++b) {
    const float* v = x + b * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    int s = 0;
    for (int j = 0; j < 32; ++j) {
      const int q = int(std::nearbyint(v[j] * id));  // the default rounding: half to even
      out.q[b * 32 + j] = int8_t(q);
      s += q;
    }
    out.d[b] = d;
    out.ds[b] = d * float(s);
    out.os[b] = -o * s;
  }
  if (!SPECJAX_Q8_512 || G % 2) return;
  out.d16.reset(new float[M * G * 8]);
  out.ds16.reset(new float[M * G * 8]());
  out.os16.reset(new int32_t[M * G * 8]());
  for (int64_t b = 0; b < M * G; ++b)  // pair b / 2, half b % 2: lanes 8 b .. 8 b + 7
    for (int l = 0; l < 8; ++l) out.d16[b * 8 + l] = out.d[b];
  for (int64_t b = 0; b < M * G; ++b) {
    out.ds16[b * 8] = out.ds[b];
    out.os16[b * 8] = out.os[b];
  }
}

// a horizontal sum in a fixed order
inline float q8_hsum(const float* lanes8) {
  float a = (lanes8[0] + lanes8[4]) + (lanes8[2] + lanes8[6]);
  float b = (lanes8[1] + lanes8[5]) + (lanes8[3] + lanes8[7]);
  return a + b;
}

#if defined(__x86_64__) && defined(__AVX2__)
inline int q8_block_bytes(int32_t type) { return block_bytes(type); }

// `q8_hsum`'s order in registers: lanes l + 4, then + 2, then + 1
inline float q8_hsum256(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
}

// weight block g of a row as 32 unsigned bytes (weight j in byte j), its scale and minimum
template <int T>
inline __m256i q8_unpack(const uint8_t* p, float& dw, float& mw) {
  dw = f16(p);
  mw = (T == Q4_1 || T == Q5_1) ? f16(p + 2) : 0.f;
  if (T == Q8_0) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_xor_si256(q, _mm256_set1_epi8(char(0x80)));  // q + 128
#else
    return q;  // signed: the dot takes |q| and moves its sign onto x
#endif
  }
  const int qs = T == Q4_0 ? 2 : T == Q4_1 ? 4 : T == Q5_0 ? 6 : 8;
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + qs));
  const __m128i low = _mm_set1_epi8(0xF);
  __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
  if (T == Q5_0 || T == Q5_1) {  // bit j of qh is bit 4 of weight j
    const uint32_t qh = u32(p + (T == Q5_0 ? 2 : 4));
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    u = _mm256_or_si256(u, _mm256_maskz_mov_epi8(static_cast<__mmask32>(qh), _mm256_set1_epi8(16)));
#else
    // byte j gets byte j / 8 of qh, then its bit j % 8 tested
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(int(qh)),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201ULL));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    u = _mm256_or_si256(u, _mm256_and_si256(set, _mm256_set1_epi8(16)));
#endif
  }
  return u;
}

// 8 int32 lanes summing to sum(u * q) + init (init: lane 0)
template <int T>
inline __m256i q8_dot(__m256i u, const int8_t* q, int32_t init) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m256i acc = _mm256_zextsi128_si256(_mm_cvtsi32_si128(init));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, x);
#else
  __m256i p;
  if (T == Q8_0) p = _mm256_maddubs_epi16(_mm256_sign_epi8(u, u), _mm256_sign_epi8(x, u));  // |w| * (x sign w)
  else p = _mm256_maddubs_epi16(u, x);  // u <= 31: no int16 saturation
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
}

// rows [m0, m0 + MT) of x times weight rows [n, n + R)
template <int T, int MT, int R>
void q8_tile(const XQ& xq, const uint8_t* __restrict w, float* __restrict y, int64_t K, int64_t N, int64_t n,
             int64_t rb, int64_t m0) {
  constexpr bool has_min = T == Q4_1 || T == Q5_1;
  const int64_t G = K / 32;
  const int bb = q8_block_bytes(T);
  __m256 acc[MT][R];
  __m128 accm[MT][R];  // lane 0: the minima's sum (scalar FMAs, as the scalar path's std::fma)
  for (int i = 0; i < MT; ++i)
    for (int r = 0; r < R; ++r) {
      acc[i][r] = _mm256_setzero_ps();
      accm[i][r] = _mm_setzero_ps();
    }
  for (int64_t g = 0; g < G; ++g) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      float dw, mw;
      _mm_prefetch(reinterpret_cast<const char*>(w + (n + r + 2 * R) * rb + g * bb), _MM_HINT_T0);  // rows ahead
      const __m256i u = q8_unpack<T>(w + (n + r) * rb + g * bb, dw, mw);
#pragma GCC unroll 8
      for (int i = 0; i < MT; ++i) {
        const int64_t b = (m0 + i) * G + g;
        const __m256i s = q8_dot<T>(u, xq.q.get() + b * 32, xq.os[b]);
        acc[i][r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xq.d[b]), _mm256_cvtepi32_ps(s), acc[i][r]);
        if (has_min) accm[i][r] = _mm_fmadd_ss(_mm_set_ss(mw), _mm_set_ss(xq.ds[b]), accm[i][r]);
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int r = 0; r < R; ++r) y[(m0 + i) * N + n + r] = q8_hsum256(acc[i][r]) + _mm_cvtss_f32(accm[i][r]);
}

#if SPECJAX_Q8_512
// With AVX-512 VNNI, two blocks a 512-bit vector (K / 32 even): one vpdpbusd per 64 weights and row,
// the scales and the minima's terms as vectors (`XQ::d16`, `ds16`, `os16`)

// blocks 2p and 2p + 1 of a row as 64 unsigned bytes, their scales and minima in 8 lanes each
template <int T>
inline __m512i q8_unpack2(const uint8_t* p, __m512& dw, __m512& mw) {
  constexpr int bb = T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : T == Q5_1 ? 24 : 34;
  const uint8_t* p1 = p + bb;
  dw = _mm512_mask_broadcastss_ps(_mm512_set1_ps(f16(p)), 0xFF00, _mm_set_ss(f16(p1)));
  if (T == Q4_1 || T == Q5_1) mw = _mm512_mask_broadcastss_ps(_mm512_set1_ps(f16(p + 2)), 0xFF00, _mm_set_ss(f16(p1 + 2)));
  if (T == Q8_0) {
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2))),
                                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1 + 2)), 1);
    return _mm512_xor_si512(q, _mm512_set1_epi8(char(0x80)));  // q + 128
  }
  constexpr int qs = T == Q4_0 ? 2 : T == Q4_1 ? 4 : T == Q5_0 ? 6 : 8;
  const __m256i v = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p1 + qs)),
                                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + qs)));
  const __m256i low = _mm256_set1_epi8(0xF);
  const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, low)),
                                       _mm256_and_si256(_mm256_srli_epi16(v, 4), low), 1);  // lo0 lo1 hi0 hi1
  __m512i u = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));                       // lo0 hi0 lo1 hi1
  if (T == Q5_0 || T == Q5_1) {
    const int at = T == Q5_0 ? 2 : 4;
    const uint64_t qh = uint64_t(u32(p + at)) | (uint64_t(u32(p1 + at)) << 32);
    u = _mm512_or_si512(u, _mm512_maskz_mov_epi8(static_cast<__mmask64>(qh), _mm512_set1_epi8(16)));
  }
  return u;
}

template <int T, int MT, int R>
void q8_tile512(const XQ& xq, const uint8_t* __restrict w, float* __restrict y, int64_t K, int64_t N, int64_t n,
                int64_t rb, int64_t m0) {
  constexpr bool has_min = T == Q4_1 || T == Q5_1;
  constexpr bool has_off = T != Q4_1 && T != Q5_1;
  const int64_t G = K / 32;
  const int bb = block_bytes(T);
  __m512 acc[MT][R];
  for (int i = 0; i < MT; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g += 2) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512 dw, mw;
      _mm_prefetch(reinterpret_cast<const char*>(w + (n + r + 2 * R) * rb + g * bb), _MM_HINT_T0);  // rows ahead
      const __m512i u = q8_unpack2<T>(w + (n + r) * rb + g * bb, dw, mw);
#pragma GCC unroll 8
      for (int i = 0; i < MT; ++i) {
        const int64_t b = (m0 + i) * G + g;  // the pair's first block; its lanes at 8 b
        const __m512i x = _mm512_loadu_si512(xq.q.get() + b * 32);
        const __m512i init = has_off ? _mm512_loadu_si512(xq.os16.get() + b * 8) : _mm512_setzero_si512();
        const __m512i s = _mm512_dpbusd_epi32(init, u, x);
        const __m512 sc = _mm512_mul_ps(dw, _mm512_loadu_ps(xq.d16.get() + b * 8));
        acc[i][r] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(s), acc[i][r]);
        if (has_min) acc[i][r] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(xq.ds16.get() + b * 8), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < MT; ++i)  // lanes l + 8 (the pair's two blocks), then `q8_hsum256`
    for (int r = 0; r < R; ++r)
      y[(m0 + i) * N + n + r] = q8_hsum256(_mm256_add_ps(_mm512_castps512_ps256(acc[i][r]),
                                                         _mm512_extractf32x8_ps(acc[i][r], 1)));
}

#endif

#if SPECJAX_Q8_X16
// Lane i holds weight row (i % 4) * 4 + i / 4 of the 16 (the in-lane 4x4 transposes' order); the map is
// its own inverse, so it also restores the rows' order at the store.
inline __m512i x16_order() { return _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0); }

// 16 bytes at p of each of 16 rows (stride rb), as 4 vectors: c[j] lane i = dword j of row order(i)
inline void x16_transpose(const uint8_t* p, int64_t rb, __m512i c[4]) {
  __m512i a[4];
  for (int k = 0; k < 4; ++k) {  // 128-bit lane q of a[k]: row 4k + q
    const uint8_t* r = p + 4 * k * rb;
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + rb)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 2 * rb)), 2);
    a[k] = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 3 * rb)), 3);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
  c[0] = _mm512_unpacklo_epi64(t0, t2);
  c[1] = _mm512_unpackhi_epi64(t0, t2);
  c[2] = _mm512_unpacklo_epi64(t1, t3);
  c[3] = _mm512_unpackhi_epi64(t1, t3);
}

// block g of the 16 rows at w (row stride rb) as 8 operands of unsigned bytes, and its scales (and minima)
template <int T>
inline void x16_unpack(const uint8_t* p, int64_t rb, __m512i vidx, __m512i u[8], __m512& dw, __m512& mw) {
  const __m512i dm = _mm512_i32gather_epi32(vidx, p, 1);  // per lane its row's first 4 bytes: d (and m)
  dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
  if (T == Q4_1) mw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
  if (T == Q8_0) {
    const __m512i bias = _mm512_set1_epi8(char(0x80));  // q + 128
    x16_transpose(p + 2, rb, u);
    x16_transpose(p + 18, rb, u + 4);
    for (int j = 0; j < 8; ++j) u[j] = _mm512_xor_si512(u[j], bias);
    return;
  }
  const __m512i low = _mm512_set1_epi8(0xF);
  x16_transpose(p + (T == Q4_0 ? 2 : 4), rb, u);
  for (int j = 0; j < 4; ++j) {
    u[4 + j] = _mm512_and_si512(_mm512_srli_epi16(u[j], 4), low);  // weights 16 + 4j ..: the high nibbles
    u[j] = _mm512_and_si512(u[j], low);
  }
}

// rows [m0, m0 + MT) of x times weight rows [n, n + 16)
template <int T, int MT>
void q8_x16_tile(const XQ& xq, const uint8_t* __restrict w, float* __restrict y, int64_t K, int64_t N, int64_t n,
                 int64_t rb, int64_t m0) {
  const int64_t G = K / 32;
  const int bb = block_bytes(T);
  const __m512i order = x16_order();
  const __m512i vidx = _mm512_mullo_epi32(order, _mm512_set1_epi32(int32_t(rb)));
  __m512 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  const uint8_t* base = w + n * rb;
  // the 16 rows are one contiguous 16 rb bytes, read 16 strided streams at a time: the next group's
  // bytes are prefetched meanwhile, a share of them per block (`#ifndef SPECJAX_Q8_X16_NO_PREFETCH`)
  const int64_t lines = 16 * rb / 64, per = (lines + G - 1) / G;
  for (int64_t g = 0; g < G; ++g) {
    __m512i u[8];
    __m512 dw, mw;
#ifndef SPECJAX_Q8_X16_NO_PREFETCH
    for (int64_t l = g * per; l < std::min(lines, (g + 1) * per); ++l)
      _mm_prefetch(reinterpret_cast<const char*>(base + 16 * rb + l * 64), _MM_HINT_T0);
#endif
    x16_unpack<T>(base + g * bb, rb, vidx, u, dw, mw);
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const int64_t b = (m0 + i) * G + g;
      const int32_t* xd = reinterpret_cast<const int32_t*>(xq.q.get() + b * 32);
      __m512i s = _mm512_set1_epi32(xq.os[b]);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) s = _mm512_dpbusd_epi32(s, u[j], _mm512_set1_epi32(xd[j]));
      acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(xq.d[b])), _mm512_cvtepi32_ps(s), acc[i]);
      if (T == Q4_1) acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xq.ds[b]), acc[i]);
    }
  }
  for (int i = 0; i < MT; ++i)
    _mm512_storeu_ps(y + (m0 + i) * N + n, _mm512_permutexvar_ps(order, acc[i]));
}
#endif

// `tile(std::integral_constant<int, MT>, m0)` over the M rows of x in balanced tiles of at most MAX
template <int MAX, int MT = MAX, class Tile>
inline void q8_tile_of(int64_t mt, int64_t m0, Tile& tile) {
  if constexpr (MT > 1)
    if (mt < MT) return q8_tile_of<MAX, MT - 1>(mt, m0, tile);
  tile(std::integral_constant<int, MT>{}, m0);
}
template <int MAX, class Tile>
void q8_tiles(int64_t M, Tile tile) {
  const int64_t tiles = (M + MAX - 1) / MAX;
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int64_t mt = (M - m + (tiles - t) - 1) / (tiles - t);
    q8_tile_of<MAX>(mt, m, tile);
    m += mt;
  }
}

// weight rows [n0, n1), 4 at a time, times every row of x: with AVX-512 VNNI and K / 32 even, two blocks
// a vector in tiles of up to 6 rows of x (24 accumulators), else a block a vector in tiles of up to 4
template <int T>
void q8_typed_rows(const XQ& xq, const uint8_t* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0,
                   int64_t n1, int64_t rb) {
  auto rows = [&](auto r, int64_t n) {
    constexpr int R = decltype(r)::value;
#if SPECJAX_Q8_512
    if (xq.d16) {
      q8_tiles<6>(M, [&](auto mt, int64_t m0) { q8_tile512<T, decltype(mt)::value, R>(xq, w, y, K, N, n, rb, m0); });
      return;
    }
#endif
    q8_tiles<4>(M, [&](auto mt, int64_t m0) { q8_tile<T, decltype(mt)::value, R>(xq, w, y, K, N, n, rb, m0); });
  };
  int64_t n = n0;
#if SPECJAX_Q8_X16
  if constexpr (q8_x16_type(T))
    for (; n + 16 <= n1; n += 16)
      q8_tiles<8>(M, [&](auto mt, int64_t m0) { q8_x16_tile<T, decltype(mt)::value>(xq, w, y, K, N, n, rb, m0); });
#endif
  for (; n + 4 <= n1; n += 4) rows(std::integral_constant<int, 4>{}, n);
  for (; n < n1; ++n) rows(std::integral_constant<int, 1>{}, n);
}
#endif

// weight block p's integers as `q8_unpack` builds them (the offset included), one weight at a time
void q8_ints(int32_t type, const uint8_t* p, int32_t* u) {
  const int qs = type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8;
  const uint32_t qh = type == Q5_0 ? u32(p + 2) : type == Q5_1 ? u32(p + 4) : 0;
  for (int j = 0; j < 32; ++j) {
    if (type == Q8_0) {
      u[j] = int32_t(int8_t(p[2 + j])) + q8_offset(Q8_0);
      continue;
    }
    const int nib = j < 16 ? p[qs + j] & 0xF : p[qs + j - 16] >> 4;
    u[j] = nib | int(((qh >> j) & 1) << 4);
  }
}

// Without AVX2: the same blocks, one weight at a time, in the vector paths' lanes (lane l sums the
// products of weights 4l .. 4l + 3, as vpdpbusd's and maddubs + madd's do): the same bits
void q8_scalar_rows(const XQ& xq, const uint8_t* w, float* y, int32_t type, int64_t M, int64_t K, int64_t N,
                    int64_t n0, int64_t n1) {
  const int64_t G = K / 32, rb = G * block_bytes(type);
  int32_t u[32];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      float acc[8] = {}, accm = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* p = w + n * rb + g * block_bytes(type);
        q8_ints(type, p, u);
        const float dw = f16(p), mw = (type == Q4_1 || type == Q5_1) ? f16(p + 2) : 0.f;
        const int64_t b = m * G + g;
        const int8_t* q = xq.q.get() + b * 32;
        for (int l = 0; l < 8; ++l) {
          int32_t s = l == 0 ? xq.os[b] : 0;
          for (int j = 4 * l; j < 4 * l + 4; ++j) s += u[j] * int32_t(q[j]);
          acc[l] = std::fma(dw * xq.d[b], float(s), acc[l]);
        }
        if (type == Q4_1 || type == Q5_1) accm = std::fma(mw, xq.ds[b], accm);
      }
      y[m * N + n] = q8_hsum(acc) + accm;
    }
  }
}

void q8_weight_rows(const XQ& xq, const uint8_t* w, float* y, int32_t type, int64_t M, int64_t K, int64_t N,
                    int64_t n0, int64_t n1) {
#if defined(__x86_64__) && defined(__AVX2__)
  const int64_t rb = K / 32 * block_bytes(type);
  switch (type) {
    case Q4_0: return q8_typed_rows<Q4_0>(xq, w, y, M, K, N, n0, n1, rb);
    case Q4_1: return q8_typed_rows<Q4_1>(xq, w, y, M, K, N, n0, n1, rb);
    case Q5_0: return q8_typed_rows<Q5_0>(xq, w, y, M, K, N, n0, n1, rb);
    case Q5_1: return q8_typed_rows<Q5_1>(xq, w, y, M, K, N, n0, n1, rb);
    case Q8_0: return q8_typed_rows<Q8_0>(xq, w, y, M, K, N, n0, n1, rb);
  }
#endif
  q8_scalar_rows(xq, w, y, type, M, K, N, n0, n1);
}

// One x times up to kMaxParts packed weights of one block type (q/k/v, gate/up): one call, x quantized
// once (q8), one split of the work over the threads, where separate calls would each pay the wake-up
// and run the small ones (k and v) on one thread. Each row's sums are the same as alone.
struct QPart {
  const uint8_t* w;
  float* y;
  int64_t N, first;  // weight rows; index of its first block
};

struct QWork {
  const float* x;
  QPart parts[kMaxParts];
  int nparts = 0;
  int32_t type;
  int64_t M, K, block, nblocks;
  bool q8 = false;  // fast mode: x quantized in xq
  XQ xq;
  std::atomic<int64_t> next{0}, done{0};
  void run() {
    for (int64_t b; (b = next.fetch_add(1, std::memory_order_relaxed)) < nblocks;) {
      int p = 0;
      while (p + 1 < nparts && b >= parts[p + 1].first) ++p;
      const QPart& q = parts[p];
      int64_t n0 = (b - q.first) * block, n1 = std::min(n0 + block, q.N);
      if (q8) q8_weight_rows(xq, q.w, q.y, type, M, K, q.N, n0, n1);
      else qweight_rows(x, q.w, q.y, type, M, K, q.N, n0, n1);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error QDenseNK(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws, ffi::RemainingRets ys,
                    int32_t qtype, int32_t mode) {
  auto xd = x.dimensions();
  const char* usage =
      "specjax_qdense_nk: needs x [M, K] fp32, 1-4 weights uint8 [N_i, K / block * bytes] and y_i [M, N_i] fp32";
  if (qtype < Q4_0 || qtype > Q6_K) return ffi::Error::InvalidArgument("specjax_qdense_nk: unknown block type code");
  if (mode != 0 && mode != 1) return ffi::Error::InvalidArgument("specjax_qdense_nk: mode is 0 (exact) or 1 (q8)");
  if (xd.size() != 2 || xd[1] % block_weights(qtype) != 0 || ws.size() < 1 || ws.size() > kMaxParts ||
      ys.size() != ws.size())
    return ffi::Error::InvalidArgument(usage);
  auto work = std::make_shared<QWork>();
  work->x = x.typed_data();
  work->type = qtype;
  work->M = xd[0];
  work->K = xd[1];
  int64_t total = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::Buffer<ffi::U8>>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument(usage);
    auto wd = w->dimensions(), yd = (*y)->dimensions();
    if (wd.size() != 2 || yd.size() != 2 || yd[0] != xd[0] || yd[1] != wd[0] ||
        wd[1] != xd[1] / block_weights(qtype) * block_bytes(qtype))
      return ffi::Error::InvalidArgument(usage);
    work->parts[i] = QPart{w->typed_data(), (*y)->typed_data(), wd[0], 0};
    total += wd[0];
  }
  work->nparts = static_cast<int>(ws.size());
  if (work->M == 0 || total == 0) return ffi::Error::Success();
  work->q8 = mode == 1 && q8_type(qtype);
  if (work->q8) q8_quantize(work->x, work->M, work->K, qtype, work->xq);
  // dense_nk's split (in weight rows; the sums do not depend on it), in whole groups of 16 rows for q8
  run_split(pool, work, total, work->q8 && SPECJAX_Q8_X16 && q8_x16_type(qtype) ? 16 : NB);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_qdense_nk, QDenseNK,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int32_t>("qtype")
                                  .Attr<int32_t>("mode"));
