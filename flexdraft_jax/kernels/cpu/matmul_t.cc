// y[N, O] = x[N, I] . w[O, I]^T in fp32 for the few rows of a decode step on a
// CPU: an AR step (N = batch), a verify block (N = batch * k) or a mask block.
//
// XLA:CPU's dot runs 2-16 rows through a GEMM built for large products: with
// the weights in DRAM, 8 rows of a [1536, 576] product took 296 us against
// 151 us for one row, although both stream the same 3.5 MB. Here a few weight
// rows at a time are read from DRAM once, prefetched ahead, and multiplied
// with every input row while they sit in L1 (a block of weight x input rows
// in registers, sized for the ISA: see kWidth), so up to ~8 rows cost about
// what one does (memory-bound) and more rows add only their multiply-adds.
//
// Every output element is summed in one fixed order whatever N is, how rows
// are grouped, or which thread runs it: lane l of a 16-lane accumulator sums
// the products at i = l, l + 16, ... in increasing i (a zero-padded tail
// last), then the 16 lanes are added in a fixed tree. A 1-token AR step and a
// 16-token verify block therefore compute bit-identical rows.
//
// Weights may also come as bf16 (FlexdraftMatmulTBf16, the draft pass): see
// block_bf16.
//
// The output rows are split into chunks that the calling thread and tasks on
// XLA's intra-op thread pool claim from a shared counter; the caller waits only
// for chunks already claimed, so a task that starts late (the pool busy) finds
// nothing left and the call never waits on the pool.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The accumulator layout (what fixes the summation order) is 16 lanes on every
// ISA; the hardware vectors that hold it, and so how many weight and input
// rows one block keeps in registers, follow the ISA the file is compiled for.
// An accumulator of kLanes floats is kParts vectors of kWidth floats; a block
// of RO weight rows x MR input rows keeps RO * MR * kParts of them, plus RO
// weight vectors and one input vector, within the register file, and loads
// RO + MR vectors for RO * MR multiply-adds:
//   AVX-512: 32 zmm, kWidth 16: 4 x 4 rows -> 16 accumulators (+4 +1), 8 loads
//            a 16 FMAs (2 x 8 took 10, and the loads bound Zen 4/5 cores);
//   AVX2:    16 ymm, kWidth 8:  2 x 3 rows -> 12 accumulators (+2 +1), where
//            2 x 8 (32 ymm) spilled and ran compute-bound at ~7 GFLOP/s a core;
//   other (SSE, NEON, ...): kWidth 4, 1 x 3 rows -> 12 of 16 (+1 +1).
// The weights are prefetched kPrefetch floats ahead of the rows in use (swept
// on Zen 3 and Zen 5 cores: 8-12 KB keeps enough lines in flight for a block
// that spends 2-4 ns on each line of a row).
// FLEXDRAFT_WEIGHT_ROWS / FLEXDRAFT_INPUT_ROWS / FLEXDRAFT_PREFETCH override
// the block and the distance (measuring).
constexpr int kLanes = 16;
#if defined(__AVX512F__)
#define FD_ISA "avx512"
constexpr int kWidth = 16;
constexpr int kDefaultWeightRows = 4, kDefaultInputRows = 4, kDefaultPrefetch = 3072;
#elif defined(__AVX2__) && defined(__FMA__)
#define FD_ISA "avx2"
constexpr int kWidth = 8;
constexpr int kDefaultWeightRows = 2, kDefaultInputRows = 3, kDefaultPrefetch = 2048;
#else
#define FD_ISA "generic"
constexpr int kWidth = 4;
constexpr int kDefaultWeightRows = 1, kDefaultInputRows = 3, kDefaultPrefetch = 2048;
#endif
#ifdef FLEXDRAFT_WEIGHT_ROWS
constexpr int kWeightRows = FLEXDRAFT_WEIGHT_ROWS;
#else
constexpr int kWeightRows = kDefaultWeightRows;
#endif
#ifdef FLEXDRAFT_INPUT_ROWS
constexpr int kMaxRows = FLEXDRAFT_INPUT_ROWS;
#else
constexpr int kMaxRows = kDefaultInputRows;
#endif
static_assert(kWeightRows >= 1 && kWeightRows <= 4 && kMaxRows >= 1 && kMaxRows <= 8,
              "blocks of 1-4 weight rows and 1-8 input rows");
constexpr int kParts = kLanes / kWidth;
#ifdef FLEXDRAFT_PREFETCH
constexpr int kPrefetch = FLEXDRAFT_PREFETCH;  // floats ahead
#else
constexpr int kPrefetch = kDefaultPrefetch;
#endif
constexpr int kMinChunk = 16;    // output rows a claim, at least

typedef float v16 __attribute__((vector_size(64)));
typedef float vw __attribute__((vector_size(kWidth * 4)));

inline vw loadw(const float* p) {
  vw v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Keeps v in a register: left to itself the compiler folds a vector's load
// into each multiply-add that uses it (an input row's into RO of them, or a
// weight row's into MR), several loads where one does, and on cores with one
// 512-bit load a cycle (Zen 4/5) the block then waits on loads.
template <class V>
inline void in_register(V& v) {
#if defined(__x86_64__) && defined(__AVX__)
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}

// The sum of a 16-lane accumulator in the one fixed tree of every build:
// lanes l and l + 8 added, then those at distance 4, 2, 1.
#if defined(__AVX512F__)
// One reduction step: c and d each hold 16 / S groups of S partial sums; the
// result holds each group halved (lane r + lane r + S/2), c's groups then d's.
template <int S>
inline v16 halve(v16 c, v16 d) {
  typedef int32_t i16 __attribute__((vector_size(64)));
  constexpr int h = S / 2;
#define FD_LO(q) ((q) < 8 ? ((q) / h) * S + (q) % h : 16 + (((q) - 8) / h) * S + ((q) - 8) % h)
  constexpr i16 lo = {FD_LO(0), FD_LO(1), FD_LO(2), FD_LO(3), FD_LO(4), FD_LO(5),
                      FD_LO(6), FD_LO(7), FD_LO(8), FD_LO(9), FD_LO(10), FD_LO(11),
                      FD_LO(12), FD_LO(13), FD_LO(14), FD_LO(15)};
#undef FD_LO
  const i16 hi = lo + h;
  return __builtin_shuffle(c, d, lo) + __builtin_shuffle(c, d, hi);
}

// The lane sums of 16 vectors, lane j of the result from a[j] (the same tree
// for every j).
inline v16 hsum16(const v16* a) {
  v16 b[8], c[4], d[2];
  for (int j = 0; j < 8; ++j) b[j] = halve<16>(a[2 * j], a[2 * j + 1]);
  for (int j = 0; j < 4; ++j) c[j] = halve<8>(b[2 * j], b[2 * j + 1]);
  for (int j = 0; j < 2; ++j) d[j] = halve<4>(c[2 * j], c[2 * j + 1]);
  return halve<2>(d[0], d[1]);
}

// y[m, r] = the lane sum of acc[r][m][0], 16 accumulators an hsum16 (each
// vector is summed by the same tree whatever vectors come with it).
template <int RO, int MR>
inline void store_sums(const vw (&acc)[RO][MR][kParts], float* __restrict y, int64_t ldy) {
  constexpr int n = RO * MR;
  for (int q0 = 0; q0 < n; q0 += kLanes) {
    v16 all[kLanes] = {};
    for (int q = q0; q < std::min(n, q0 + kLanes); ++q) all[q - q0] = acc[q / MR][q % MR][0];
    float sums[kLanes];
    const v16 s = hsum16(all);
    std::memcpy(sums, &s, sizeof(s));
    for (int q = q0; q < std::min(n, q0 + kLanes); ++q) y[(q % MR) * ldy + q / MR] = sums[q - q0];
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// lanes 0-7 + lanes 8-15 (distance 8), then halves of 128 bits (4), then 2, 1
inline float lane_sum(const vw (&a)[kParts]) {
  const __m256 t = (__m256)(a[0] + a[1]);
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
}

template <int RO, int MR>
inline void store_sums(const vw (&acc)[RO][MR][kParts], float* __restrict y, int64_t ldy) {
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < RO; ++r) y[m * ldy + r] = lane_sum(acc[r][m]);
}
#else
inline float lane_sum(const vw (&a)[kParts]) {
  float l[kLanes];
  std::memcpy(l, a, sizeof(l));
  for (int s = kLanes / 2; s >= 1; s /= 2)
    for (int j = 0; j < s; ++j) l[j] += l[j + s];
  return l[0];
}

template <int RO, int MR>
inline void store_sums(const vw (&acc)[RO][MR][kParts], float* __restrict y, int64_t ldy) {
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < RO; ++r) y[m * ldy + r] = lane_sum(acc[r][m]);
}
#endif

// RO weight rows against MR input rows. x: MR rows of I floats (stride I);
// xt: their zero-padded tails (stride kLanes); wt: the weight rows' tails
// (stride kLanes). Lane l of an accumulator sums the products at i = l,
// l + 16, ... in increasing i, whatever the ISA (a part p of kWidth lanes
// holds lanes p * kWidth ...).
template <int RO, int MR>
void block(const float* __restrict x, const float* __restrict xt, int I,
           const float* __restrict w, const float* __restrict wt,
           float* __restrict y, int64_t ldy) {
  vw acc[RO][MR][kParts];
  for (int r = 0; r < RO; ++r)
    for (int m = 0; m < MR; ++m)
      for (int p = 0; p < kParts; ++p) acc[r][m][p] = vw{};
  const int body = I - I % kLanes;
  for (int i = 0; i < body; i += kLanes) {
    if (kPrefetch)
      for (int r = 0; r < RO; ++r) __builtin_prefetch(w + (int64_t)r * I + i + kPrefetch);
#pragma GCC unroll 4
    for (int p = 0; p < kParts; ++p) {
      vw wv[RO];
      for (int r = 0; r < RO; ++r) {
        wv[r] = loadw(w + (int64_t)r * I + i + p * kWidth);
        in_register(wv[r]);
      }
      for (int m = 0; m < MR; ++m) {
        vw xv = loadw(x + (int64_t)m * I + i + p * kWidth);
        in_register(xv);
        for (int r = 0; r < RO; ++r) acc[r][m][p] += xv * wv[r];
      }
    }
  }
  if (body < I) {
    for (int p = 0; p < kParts; ++p)
      for (int m = 0; m < MR; ++m) {
        const vw xv = loadw(xt + m * kLanes + p * kWidth);
        for (int r = 0; r < RO; ++r) acc[r][m][p] += xv * loadw(wt + r * kLanes + p * kWidth);
      }
  }
  store_sums<RO, MR>(acc, y, ldy);
}

// bf16 weights (the draft pass, whose drafts need not match the target's
// arithmetic): x is rounded to bf16 once per call, every product of a bf16
// pair is exact in fp32, and lane l of a 16-lane accumulator sums the pairs
// at i = 32 j + 2 l, 32 j + 2 l + 1 in increasing j — with AVX512-BF16 one
// vdpbf16ps, twice the multiplies of an fp32 FMA, on half the bytes (else,
// or with FLEXDRAFT_GENERIC_BF16 defined, the pairs widened to fp32).
constexpr int kPair = 2 * kLanes;  // bf16 values an accumulator covers
constexpr int kPairW = 2 * kWidth;  // bf16 values a hardware vector holds

typedef uint32_t uw __attribute__((vector_size(kWidth * 4)));  // kWidth bf16 pairs

inline uw load_pairs(const uint16_t* p) {
  uw v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// acc + the pair sums of x . w (lane l: x[2l] w[2l] + x[2l+1] w[2l+1])
inline vw dot_pairs(vw acc, uw x, uw w) {
#if defined(__AVX512BF16__) && defined(__AVX512F__) && !defined(FLEXDRAFT_GENERIC_BF16)
  return (vw)_mm512_dpbf16_ps((__m512)acc, (__m512bh)x, (__m512bh)w);
#else
  // lane l: value 2l in the low half, 2l + 1 in the high half
  const vw x0 = (vw)(x << 16), x1 = (vw)(x & 0xFFFF0000u);
  const vw w0 = (vw)(w << 16), w1 = (vw)(w & 0xFFFF0000u);
  return acc + (x0 * w0 + x1 * w1);
#endif
}

// fp32 -> bf16, rounded to nearest even (NaN stays NaN)
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

// RO weight rows (bf16) against MR input rows (bf16, stride ldx, zero-padded
// to a multiple of kPair); wt: the weight rows' zero-padded tails.
template <int RO, int MR>
void block_bf16(const uint16_t* __restrict x, int64_t ldx, int I,
                const uint16_t* __restrict w, const uint16_t* __restrict wt,
                float* __restrict y, int64_t ldy) {
  vw acc[RO][MR][kParts];
  for (int r = 0; r < RO; ++r)
    for (int m = 0; m < MR; ++m)
      for (int p = 0; p < kParts; ++p) acc[r][m][p] = vw{};
  const int body = I - I % kPair;
  for (int i = 0; i < body; i += kPair) {
    for (int r = 0; r < RO; ++r) __builtin_prefetch(w + (int64_t)r * I + i + 2 * kPrefetch);
#pragma GCC unroll 4
    for (int p = 0; p < kParts; ++p) {
      uw wv[RO];
      for (int r = 0; r < RO; ++r) {
        wv[r] = load_pairs(w + (int64_t)r * I + i + p * kPairW);
        in_register(wv[r]);
      }
      for (int m = 0; m < MR; ++m) {
        uw xv = load_pairs(x + m * ldx + i + p * kPairW);
        in_register(xv);
        for (int r = 0; r < RO; ++r) acc[r][m][p] = dot_pairs(acc[r][m][p], xv, wv[r]);
      }
    }
  }
  if (body < I) {
    for (int p = 0; p < kParts; ++p)
      for (int m = 0; m < MR; ++m) {
        const uw xv = load_pairs(x + m * ldx + body + p * kPairW);
        for (int r = 0; r < RO; ++r)
          acc[r][m][p] = dot_pairs(acc[r][m][p], xv, load_pairs(wt + r * kPair + p * kPairW));
      }
  }
  store_sums<RO, MR>(acc, y, ldy);
}

// Dispatches a run-time row count 1..MR to the template instances.
template <int RO, int MR, template <int, int> class Block>
struct ByRows {
  template <class... A>
  static void call(int mr, A... a) {
    if constexpr (MR > 1) {
      if (mr < MR) return ByRows<RO, MR - 1, Block>::call(mr, a...);
    }
    Block<RO, MR>::run(a...);
  }
};

template <int RO, int MR>
struct F32Block {
  static void run(const float* x, const float* xt, int I, const float* w,
                  const float* wt, float* y, int64_t ldy) {
    block<RO, MR>(x, xt, I, w, wt, y, ldy);
  }
};

template <int RO, int MR>
struct Bf16Block {
  static void run(const uint16_t* x, int64_t ldx, int I, const uint16_t* w,
                  const uint16_t* wt, float* y, int64_t ldy) {
    block_bf16<RO, MR>(x, ldx, I, w, wt, y, ldy);
  }
};

// A run-time weight-row count 1..RO to R's block for that many.
template <int RO, class R>
inline void call_rows(const R& r, int ro, int mr, int64_t n0, int64_t o,
                      const typename R::W* wt, float* y, int64_t ldy) {
  if constexpr (RO > 1) {
    if (ro < RO) return call_rows<RO - 1>(r, ro, mr, n0, o, wt, y, ldy);
  }
  r.template call<RO>(mr, n0, o, wt, y, ldy);
}

// Weight rows o0..o1, kWeightRows at a time, each group against every input
// row (kMaxRows a pass, the group's weights read from L1 after the first);
// R supplies the weights (R::W, tails of R::kTail values) and calls its block.
template <class R>
void row_groups(const R& r, int64_t o0, int64_t o1, float* y, int64_t O) {
  typedef typename R::W W;
  constexpr int TW = R::kTail;
  const int64_t tail = r.I % TW, body = r.I - tail;
  // the input rows in passes of at most kMaxRows, as even as they go (6 rows
  // of a 4-row block: 3 + 3, not 4 + 2)
  const int64_t passes = (r.N + kMaxRows - 1) / kMaxRows;
  const int64_t pass = (r.N + passes - 1) / passes;
  for (int64_t o = o0; o < o1; o += kWeightRows) {
    const int ro = (int)std::min<int64_t>(kWeightRows, o1 - o);
    W wt[kWeightRows * TW] = {};
    for (int q = 0; q < ro; ++q)
      std::memcpy(wt + q * TW, r.w + (o + q) * r.I + body, tail * sizeof(W));
    for (int64_t n0 = 0; n0 < r.N; n0 += pass) {
      const int mr = (int)std::min<int64_t>(pass, r.N - n0);
      call_rows<kWeightRows>(r, ro, mr, n0, o, wt, y + n0 * O + o, O);
    }
  }
}

// fp32 weights: x as it is, plus its rows' zero-padded tails.
struct F32Rows {
  typedef float W;
  static constexpr int kTail = kLanes;
  const float* x;
  const float* w;
  int64_t N, I;
  std::unique_ptr<float[]> xtail;  // [N, kLanes]

  F32Rows(const float* x_, const float* w_, int64_t N_, int64_t I_)
      : x(x_), w(w_), N(N_), I(I_), xtail(new float[N_ * kLanes]()) {
    const int64_t body = I - I % kLanes;
    for (int64_t n = 0; n < N; ++n)
      std::memcpy(xtail.get() + n * kLanes, x + n * I + body, (I - body) * sizeof(float));
  }

  template <int RO>
  void call(int mr, int64_t n0, int64_t o, const float* wt, float* y, int64_t ldy) const {
    ByRows<RO, kMaxRows, F32Block>::call(mr, x + n0 * I, xtail.get() + n0 * kLanes, (int)I,
                               w + o * I, wt, y, ldy);
  }
};

// bf16 weights: x rounded to bf16, rows padded to a multiple of kPair.
struct Bf16Rows {
  typedef uint16_t W;
  static constexpr int kTail = kPair;
  const uint16_t* w;
  int64_t N, I, ldx;
  std::unique_ptr<uint16_t[]> xb;  // [N, ldx]

  Bf16Rows(const float* x, const uint16_t* w_, int64_t N_, int64_t I_)
      : w(w_), N(N_), I(I_), ldx((I_ + kPair - 1) / kPair * kPair),
        xb(new uint16_t[N_ * ldx]()) {
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < I; ++i) xb[n * ldx + i] = to_bf16(x[n * I + i]);
  }

  template <int RO>
  void call(int mr, int64_t n0, int64_t o, const uint16_t* wt, float* y,
            int64_t ldy) const {
    ByRows<RO, kMaxRows, Bf16Block>::call(mr, xb.get() + n0 * ldx, ldx, (int)I, w + o * I, wt, y, ldy);
  }
};

// Output rows in chunks, claimed from a shared counter by the caller and by
// tasks on XLA's pool; the caller waits only for claimed chunks.
template <class Rows>
struct Job {
  Rows r;
  float* y;
  int64_t O, chunk, chunks;
  std::atomic<int64_t> next{0}, done{0};

  Job(Rows&& rows, float* y_, int64_t O_, int64_t threads)
      : r(std::move(rows)), y(y_), O(O_) {
    // a few chunks a thread: long contiguous runs of weight rows to stream
    chunk = std::max<int64_t>(kMinChunk, (O + 4 * threads - 1) / (4 * threads));
    chunk = (chunk + kWeightRows - 1) / kWeightRows * kWeightRows;
    chunks = (O + chunk - 1) / chunk;
  }

  void work() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      row_groups(r, c * chunk, std::min(O, (c + 1) * chunk), y, O);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <class Rows>
void run(ffi::ThreadPool& pool, Rows&& rows, float* y, int64_t O) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  auto job = std::make_shared<Job<Rows>>(std::move(rows), y, O, threads);
  const int64_t helpers = std::min<int64_t>(threads, job->chunks) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < job->chunks)
    std::this_thread::yield();
}

template <ffi::DataType W>
ffi::Error MatmulT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<W> w,
                   ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("matmul_t: x must be [N, I] and w [O, I]");
  const int64_t N = xd[0], I = xd[1], O = wd[0];
  if constexpr (W == ffi::DataType::BF16)
    run(pool, Bf16Rows(x.typed_data(), w.typed_data(), N, I), y->typed_data(), O);
  else
    run(pool, F32Rows(x.typed_data(), w.typed_data(), N, I), y->typed_data(), O);
  return ffi::Error::Success();
}

}  // namespace

#define FD_MATMUL_HANDLER(NAME, W)                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, MatmulT<W>,                     \
                                ffi::Ffi::Bind()                      \
                                    .Ctx<ffi::ThreadPool>()           \
                                    .Arg<ffi::Buffer<ffi::F32>>()     \
                                    .Arg<ffi::Buffer<W>>()            \
                                    .Ret<ffi::Buffer<ffi::F32>>());

FD_MATMUL_HANDLER(FlexdraftMatmulT, ffi::DataType::F32)
FD_MATMUL_HANDLER(FlexdraftMatmulTBf16, ffi::DataType::BF16)

// The build's ISA and register blocking, e.g. "avx2 2x3": the key of step
// costs measured with it (flexdraft_jax.kernels.cpu_matmul.build_info).
extern "C" const char* FlexdraftMatmulTBuild() {
  static char text[64];
  std::snprintf(text, sizeof(text), "%s %dx%d", FD_ISA, kWeightRows, kMaxRows);
  return text;
}

// Roofline probes at the build's vector width (launch/bench_cpu_roofline.py),
// one thread each (call them from several threads for the whole CPU).

// GFLOP/s of multiply-adds on registers alone: 16 independent accumulators,
// enough to cover any core's FMA latency x throughput.
extern "C" double FlexdraftFmaGflops(int64_t iters) {
  volatile float one = 1.0f, factor = 0.999f, step = 1e-3f;  // unknown when compiling
  vw a[16], b, c;
  for (int l = 0; l < kWidth; ++l) b[l] = factor, c[l] = step;
  for (int j = 0; j < 16; ++j)
    for (int l = 0; l < kWidth; ++l) a[j][l] = one + step * (j + l);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t k = 0; k < iters; ++k) {
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) a[j] = a[j] * b + c;
  }
  float sink = 0;
  for (int j = 0; j < 16; ++j) sink += a[j][0];
  volatile float keep = sink;  // stored before the clock is read again
  (void)keep;
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return 2.0 * 16 * kWidth * iters / s / 1e9;
}

// GB/s of one pass reading n floats (a buffer far larger than the caches: the
// stream bandwidth one thread gets from DRAM), the best of reps passes.
extern "C" double FlexdraftReadGBps(const float* p, int64_t n, int reps) {
  double best = 0;
  for (int rep = 0; rep < reps; ++rep) {
    vw s[4] = {};
    const auto t0 = std::chrono::steady_clock::now();
    int64_t i = 0;
    for (; i + 4 * kWidth <= n; i += 4 * kWidth)
      for (int j = 0; j < 4; ++j) s[j] += loadw(p + i + j * kWidth);
    volatile float keep = (s[0] + s[1] + s[2] + s[3])[0];
    (void)keep;
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 4.0 * i / sec / 1e9);
  }
  return best;
}
