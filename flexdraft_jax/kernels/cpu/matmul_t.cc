// y[N, O] = x[N, I] . w[O, I]^T in fp32 for the few rows of a decode step on a
// CPU: an AR step (N = batch), a verify block (N = batch * k) or a mask block.
//
// XLA:CPU's dot runs 2-16 rows through a GEMM built for large products: with
// the weights in DRAM, 8 rows of a [1536, 576] product took 296 us against
// 151 us for one row, although both stream the same 3.5 MB. Here every weight
// row is read once for up to 8 input rows (two weight rows at a time, 16 lanes
// a vector, prefetched 1 KB ahead), so up to 8 rows cost about what one does
// (memory-bound); more rows take one pass over the weights per 8.
//
// Every output element is summed in one fixed order whatever N is, how rows
// are grouped, or which thread runs it: lane l of a 16-lane accumulator sums
// the products at i = l, l + 16, ... in increasing i (a zero-padded tail
// last), then the 16 lanes are added in a fixed tree. A 1-token AR step and a
// 16-token verify block therefore compute bit-identical rows.
//
// The output rows are split into chunks that the calling thread and tasks on
// XLA's intra-op thread pool claim from a shared counter; the caller waits only
// for chunks already claimed, so a task that starts late (the pool busy) finds
// nothing left and the call never waits on the pool.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));

constexpr int kLanes = 16;
constexpr int kMaxRows = 8;      // input rows per pass over the weights
constexpr int kPrefetch = 1024;   // floats ahead (4 KB)
constexpr int kMinChunk = 16;    // output rows a claim, at least

inline v16 load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

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

// The lane sums of 16 vectors, lane j of the result from a[j]: lanes l and
// l + 8 added, then those at distance 4, 2, 1 (the same tree for every j).
inline v16 hsum16(const v16* a) {
  v16 b[8], c[4], d[2];
  for (int j = 0; j < 8; ++j) b[j] = halve<16>(a[2 * j], a[2 * j + 1]);
  for (int j = 0; j < 4; ++j) c[j] = halve<8>(b[2 * j], b[2 * j + 1]);
  for (int j = 0; j < 2; ++j) d[j] = halve<4>(c[2 * j], c[2 * j + 1]);
  return halve<2>(d[0], d[1]);
}

// RO (1 or 2) weight rows against MR (1..8) input rows. x: MR rows of I
// floats (stride I); xt: their zero-padded tails (stride kLanes); wt: the
// weight rows' tails (stride kLanes).
template <int RO, int MR>
void block(const float* __restrict x, const float* __restrict xt, int I,
           const float* __restrict w, const float* __restrict wt,
           float* __restrict y, int64_t ldy) {
  v16 acc[RO][MR];
  for (int r = 0; r < RO; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = v16{};
  const int body = I - I % kLanes;
  for (int i = 0; i < body; i += kLanes) {
    v16 wv[RO];
    for (int r = 0; r < RO; ++r) {
      __builtin_prefetch(w + (int64_t)r * I + i + kPrefetch);
      wv[r] = load(w + (int64_t)r * I + i);
    }
    for (int m = 0; m < MR; ++m) {
      const v16 xv = load(x + (int64_t)m * I + i);
      for (int r = 0; r < RO; ++r) acc[r][m] += xv * wv[r];
    }
  }
  if (body < I) {
    for (int m = 0; m < MR; ++m) {
      const v16 xv = load(xt + m * kLanes);
      for (int r = 0; r < RO; ++r) acc[r][m] += xv * load(wt + r * kLanes);
    }
  }
  v16 all[kLanes] = {};
  for (int r = 0; r < RO; ++r)
    for (int m = 0; m < MR; ++m) all[r * MR + m] = acc[r][m];
  float sums[kLanes];
  const v16 s = hsum16(all);
  std::memcpy(sums, &s, sizeof(s));
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < RO; ++r) y[m * ldy + r] = sums[r * MR + m];
}

template <int RO>
void block_rows(int mr, const float* x, const float* xt, int I, const float* w,
                const float* wt, float* y, int64_t ldy) {
  switch (mr) {
    case 1: return block<RO, 1>(x, xt, I, w, wt, y, ldy);
    case 2: return block<RO, 2>(x, xt, I, w, wt, y, ldy);
    case 3: return block<RO, 3>(x, xt, I, w, wt, y, ldy);
    case 4: return block<RO, 4>(x, xt, I, w, wt, y, ldy);
    case 5: return block<RO, 5>(x, xt, I, w, wt, y, ldy);
    case 6: return block<RO, 6>(x, xt, I, w, wt, y, ldy);
    case 7: return block<RO, 7>(x, xt, I, w, wt, y, ldy);
    default: return block<RO, 8>(x, xt, I, w, wt, y, ldy);
  }
}

struct Job {
  const float* x;
  const float* w;
  float* y;
  int64_t N, I, O, chunk, chunks;
  std::unique_ptr<float[]> xtail;  // [N, kLanes], zero-padded tails of x
  std::atomic<int64_t> next{0}, done{0};

  void rows(int64_t o0, int64_t o1) const {
    const int64_t tail = I % kLanes, body = I - tail;
    for (int64_t o = o0; o < o1; o += 2) {
      const int ro = o + 1 < o1 ? 2 : 1;
      float wt[2 * kLanes] = {};
      for (int r = 0; r < ro; ++r)
        std::memcpy(wt + r * kLanes, w + (o + r) * I + body, tail * sizeof(float));
      for (int64_t n0 = 0; n0 < N; n0 += kMaxRows) {
        const int mr = (int)std::min<int64_t>(kMaxRows, N - n0);
        const float* xn = x + n0 * I;
        const float* xt = xtail.get() + n0 * kLanes;
        float* yn = y + n0 * O + o;
        if (ro == 2) block_rows<2>(mr, xn, xt, (int)I, w + o * I, wt, yn, O);
        else block_rows<1>(mr, xn, xt, (int)I, w + o * I, wt, yn, O);
      }
    }
  }

  void work() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      rows(c * chunk, std::min(O, (c + 1) * chunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error MatmulT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                   ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("matmul_t: x must be [N, I] and w [O, I]");
  auto job = std::make_shared<Job>();
  job->x = x.typed_data();
  job->w = w.typed_data();
  job->y = y->typed_data();
  job->N = xd[0];
  job->I = xd[1];
  job->O = wd[0];
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // a few chunks a thread: long contiguous runs of weight rows to stream
  job->chunk = std::max<int64_t>(kMinChunk, (job->O + 4 * threads - 1) / (4 * threads));
  job->chunk += job->chunk % 2;
  job->chunks = (job->O + job->chunk - 1) / job->chunk;
  const int64_t tail = job->I % kLanes, body = job->I - tail;
  job->xtail.reset(new float[job->N * kLanes]());
  for (int64_t n = 0; n < job->N; ++n)
    std::memcpy(job->xtail.get() + n * kLanes, job->x + n * job->I + body,
                tail * sizeof(float));
  const int64_t helpers =
      std::min<int64_t>(threads, job->chunks) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < job->chunks)
    std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlexdraftMatmulT, MatmulT,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
