// The host optimizer steps on flat shards, one pass over memory (AdamW, Lion) or three (a
// factored Adafactor matrix: only the last reads the main, and it leaves the main's sum of
// squares for the next step's first), built and loaded by host_kernels.py. Every element's
// update is the reference's (torch's fused CPU AdamW, optim/lion.py, optim/adafactor.py),
// operation by operation in fp32, with fmaf exactly where torch's kernels use one; the file is
// compiled with -ffp-contract=off so the compiler adds no other fusion. Tensors of any of the
// dtypes fp32 (0), bf16 (1), fp16 (2) are converted to fp32 a block at a time in L1-resident
// buffers and rounded back to nearest-even. Work is split over `threads` std::threads in ranges
// whose results do not depend on the split (sums are taken in fixed row blocks and lanes).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

constexpr int64_t BLOCK = 512;        // elements staged per buffer (2 KiB each in fp32)
constexpr int64_t ROWS_PER_UNIT = 64; // rows of a factored matrix summed by one task
constexpr int LANES = 16;             // accumulators of one row's sums
constexpr int64_t SERIAL_BELOW = 65536;  // shards smaller than this are not worth starting threads for

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // c10::BFloat16's round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// A tensor as fp32: the array itself (fp32) or a block converted into `buf`.
inline const float* load(const void* src, int dtype, int64_t off, int64_t n, float* buf) {
  if (dtype == 0) return static_cast<const float*>(src) + off;
  if (dtype == 1) {
    const uint16_t* s = static_cast<const uint16_t*>(src) + off;
    for (int64_t i = 0; i < n; ++i) buf[i] = bf16_to_float(s[i]);
  } else {
    const _Float16* s = static_cast<const _Float16*>(src) + off;
    int64_t i = 0;
#ifdef __F16C__  // GCC does not vectorize _Float16 conversions without AVX512-FP16
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
#endif
    for (; i < n; ++i) buf[i] = static_cast<float>(s[i]);
  }
  return buf;
}

// Where to compute a tensor that is written: the array itself (fp32) or `buf`.
inline float* target(void* dst, int dtype, int64_t off, float* buf) {
  return dtype == 0 ? static_cast<float*>(dst) + off : buf;
}

inline void store(void* dst, int dtype, int64_t off, int64_t n, const float* val) {
  if (dtype == 0) {
    float* d = static_cast<float*>(dst) + off;
    if (d != val) std::memcpy(d, val, n * 4);
  } else if (dtype == 1) {
    uint16_t* d = static_cast<uint16_t*>(dst) + off;
    for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(val[i]);
  } else {
    _Float16* d = static_cast<_Float16*>(dst) + off;
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(val + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; ++i) d[i] = static_cast<_Float16>(val[i]);
  }
}

// Runs f(begin, end) over [0, n) split into `threads` ranges aligned to 64 elements.
// The most threads one kernel call on this (calling) thread ran on since it was last read
// (peak_threads): what the tests compare with the planner's --host-optimizer-threads.
thread_local int peak = 0;

inline void ran_on(int threads) { peak = std::max(peak, threads); }

template <class F>
void parallel(int64_t n, int threads, F f) {
  if (threads <= 1 || n < SERIAL_BELOW) {
    ran_on(1);
    f(0, n);
    return;
  }
  int64_t per = ((n + threads - 1) / threads + 63) / 64 * 64;
  std::vector<std::thread> pool;
  for (int t = 1; t < threads && t * per < n; ++t) pool.emplace_back(f, t * per, std::min(n, (t + 1) * per));
  ran_on(static_cast<int>(pool.size()) + 1);
  f(0, std::min(n, per));
  for (auto& th : pool) th.join();
}

// Runs f(unit) for unit in [0, units) on `threads` threads (each unit writes its own outputs).
template <class F>
void parallel_units(int64_t units, int threads, F f) {
  std::atomic<int64_t> next(0);
  auto work = [&]() {
    for (int64_t u; (u = next.fetch_add(1)) < units;) f(u);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads && t < units; ++t) pool.emplace_back(work);
  ran_on(static_cast<int>(pool.size()) + 1);
  work();
  for (auto& th : pool) th.join();
}

// torch's lerp(a, b, w) for a scalar weight, as its vectorized kernel computes it.
inline float lerp(float a, float b, float w, float w_minus_1, bool small) {
  return small ? std::fmaf(w, b - a, a) : std::fmaf(w_minus_1, b - a, b);
}

// The rows of a flat range [start, start + n) of a (batches * rows) x cols matrix, in units of
// at most ROWS_PER_UNIT rows that never cross a matrix.
struct Units {
  int64_t start, end, rows, cols, lo, hi, first_matrix;
  std::vector<int64_t> row0;  // each unit's first row; the last entry is hi
  Units(int64_t start_, int64_t n, int64_t rows_, int64_t cols_)
      : start(start_), end(start_ + n), rows(rows_), cols(cols_) {
    lo = start / cols;
    hi = (end + cols - 1) / cols;
    first_matrix = lo / rows;
    for (int64_t r = lo; r < hi;) {
      row0.push_back(r);
      int64_t matrix_end = (r / rows + 1) * rows;
      r = std::min({hi, matrix_end, (r / ROWS_PER_UNIT + 1) * ROWS_PER_UNIT});
    }
    row0.push_back(hi);
  }
  int64_t count() const { return static_cast<int64_t>(row0.size()) - 1; }
  int64_t matrix(int64_t unit) const { return row0[unit] / rows; }
  // The flat range of row r inside the piece.
  int64_t row_begin(int64_t r) const { return std::max(start, r * cols); }
  int64_t row_end(int64_t r) const { return std::min(end, (r + 1) * cols); }
};

// A row's sum in LANES fp32 lanes (element i of the row goes to lane i % LANES), the lanes
// added in double in lane order: the same whatever the threads.
struct Lanes {
  alignas(64) float lane[LANES] = {0};
  double total() const {
    double s = 0;
    for (int k = 0; k < LANES; ++k) s += lane[k];
    return s;
  }
};

typedef float lanes_t __attribute__((vector_size(LANES * 4)));  // LANES floats, one register on AVX-512

inline lanes_t load_lanes(const float* x) {
  lanes_t v;
  std::memcpy(&v, x, sizeof v);
  return v;
}

inline void store_lanes(float* x, lanes_t v) { std::memcpy(x, &v, sizeof v); }

// Pass 1 on one block of a row: g^2 into the row's lanes and the column sums, w^2 into its lanes.
void sums_block(int64_t len, const float* g, const float* p, float* col, float* row_lanes, float* sq_lanes) {
  lanes_t rl = load_lanes(row_lanes), wl = load_lanes(sq_lanes);
  int64_t i = 0;
  for (; i + LANES <= len; i += LANES) {
    lanes_t gv = load_lanes(g + i), pv = load_lanes(p + i), x = gv * gv;
    rl += x;
    store_lanes(col + i, load_lanes(col + i) + x);
    wl += pv * pv;
  }
  store_lanes(row_lanes, rl);
  store_lanes(sq_lanes, wl);
  for (int l = 0; i < len; ++i, ++l) {
    float x = g[i] * g[i];
    row_lanes[l] += x;
    col[i] += x;
    sq_lanes[l] += p[i] * p[i];
  }
}

// Pass 1 without the main: g^2 into the row's lanes and the column sums.
void grad_sums_block(int64_t len, const float* g, float* col, float* row_lanes) {
  lanes_t rl = load_lanes(row_lanes);
  int64_t i = 0;
  for (; i + LANES <= len; i += LANES) {
    lanes_t gv = load_lanes(g + i), x = gv * gv;
    rl += x;
    store_lanes(col + i, load_lanes(col + i) + x);
  }
  store_lanes(row_lanes, rl);
  for (int l = 0; i < len; ++i, ++l) {
    float x = g[i] * g[i];
    row_lanes[l] += x;
    col[i] += x;
  }
}

// Pass 2's lanes: the sum of one block of a row.
void add_block(int64_t len, const float* x, float* lanes) {
  lanes_t acc = load_lanes(lanes);
  int64_t i = 0;
  for (; i + LANES <= len; i += LANES) acc += load_lanes(x + i);
  store_lanes(lanes, acc);
  for (int l = 0; i < len; ++i, ++l) lanes[l] += x[i];
}

// Pass 3's lanes, of the new main: u^2 of one block of a row.
void squares_block(int64_t len, const float* u, float* lanes) {
  lanes_t acc = load_lanes(lanes);
  int64_t i = 0;
  for (; i + LANES <= len; i += LANES) {
    lanes_t v = load_lanes(u + i);
    acc += v * v;
  }
  store_lanes(lanes, acc);
  for (int l = 0; i < len; ++i, ++l) lanes[l] += u[i] * u[i];
}

// Per-matrix totals of per-unit partials, added in unit order.
void reduce_units(const Units& u, const std::vector<double>& partial, int64_t width, float* out, int64_t out_width) {
  std::vector<double> acc;
  int64_t current = -1;
  auto flush = [&]() {
    if (current < 0) return;
    for (int64_t j = 0; j < width; ++j) out[current * out_width + j] = static_cast<float>(acc[j]);
  };
  for (int64_t k = 0; k < u.count(); ++k) {
    if (u.matrix(k) != current) {
      flush();
      current = u.matrix(k);
      acc.assign(width, 0.0);
    }
    for (int64_t j = 0; j < width; ++j) acc[j] += partial[k * width + j];
  }
  flush();
}

struct AdamScalars {
  float decay, w, w1, beta2, sq_coeff, bc2_sqrt, eps, neg_step_size;
  bool small;
};

// One element of AdamW in fp32, as torch's fused CPU kernel computes it. Its second moment is
// rounded one way in the kernel's vector loops, fma(c2 g, g, beta2 v), and another in its scalar
// loop over a tensor's last n % 8 elements (the loop after the 16-wide body and the compiler's
// 8-wide remainder), fma(v, beta2, c2 g g): `scalar` selects the latter.
template <bool scalar>
inline void adam_element(int64_t i, const float* pi, const float* g, const float* mi, const float* vi, float* po,
                         float* mo, float* vo, const AdamScalars& a) {
  float p = pi[i] * a.decay;
  float m = lerp(mi[i], g[i], a.w, a.w1, a.small);
  float v = scalar ? std::fmaf(vi[i], a.beta2, a.sq_coeff * g[i] * g[i])
                   : std::fmaf(a.sq_coeff * g[i], g[i], vi[i] * a.beta2);
  float denom = std::sqrt(v) / a.bc2_sqrt + a.eps;
  mo[i] = m;
  vo[i] = v;
  po[i] = p + a.neg_step_size * m / denom;
}

// One block of AdamW in fp32: elements [0, vector_end) as torch's vector loops, the rest as its
// scalar tail. An output may be its input (an fp32 tensor updated in place): element i reads
// and writes index i only, which ivdep tells the vectorizer.
void adam_math(int64_t k, int64_t vector_end, const float* pi, const float* g, const float* mi, const float* vi,
               float* po, float* mo, float* vo, const AdamScalars a) {
#pragma GCC ivdep
  for (int64_t i = 0; i < vector_end; ++i) adam_element<false>(i, pi, g, mi, vi, po, mo, vo, a);
  for (int64_t i = vector_end; i < k; ++i) adam_element<true>(i, pi, g, mi, vi, po, mo, vo, a);
}

struct LionScalars {
  float decay, neg_lr, w1, w1m1, w2, w2m1;
  bool small1, small2;
};

// One block of Lion in fp32; `decay` multiplies the main first (1 when it was decayed and rounded
// already). Outputs may be their inputs, as in adam_math.
void lion_math(int64_t k, const float* pi, const float* g, const float* mi, float* po, float* mo, float decay,
               const LionScalars a) {
  const float lr = a.neg_lr, w1 = a.w1, w1m1 = a.w1m1, w2 = a.w2, w2m1 = a.w2m1;
  const bool small1 = a.small1, small2 = a.small2;
#pragma GCC ivdep
  for (int64_t i = 0; i < k; ++i) {
    const float m = mi[i], gi = g[i], c = lerp(m, gi, w1, w1m1, small1);
    const float s = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : c);
    po[i] = std::fmaf(s, lr, pi[i] * decay);
    mo[i] = lerp(m, gi, w2, w2m1, small2);
  }
}

}  // namespace

extern "C" {

// AdamW (torch's fused CPU kernel, ADAMW mode, bitwise: tests/optim/test_host_kernels.py) on
// the n elements of one tensor; `weight` (dtype wdt) receives the updated parameter rounded to
// 16 bits when not null.
void adamw_step(int64_t n, void* param, int pdt, const void* grad, int gdt, void* exp_avg, int mdt,
                void* exp_avg_sq, int vdt, void* weight, int wdt, float decay, float lerp_w, float lerp_w1,
                int small, float beta2, float sq_coeff, float bc2_sqrt, float eps, float neg_step_size,
                int threads) {
  const AdamScalars a{decay, lerp_w, lerp_w1, beta2, sq_coeff, bc2_sqrt, eps, neg_step_size, small != 0};
  const int64_t tail = n - n % 8;  // where torch's scalar loop starts
  parallel(n, threads, [=](int64_t begin, int64_t end) {
    float pb[BLOCK], gb[BLOCK], mb[BLOCK], vb[BLOCK];
    for (int64_t off = begin; off < end; off += BLOCK) {
      int64_t k = std::min(BLOCK, end - off), vector_end = std::clamp<int64_t>(tail - off, 0, k);
      float *po = target(param, pdt, off, pb), *mo = target(exp_avg, mdt, off, mb), *vo = target(exp_avg_sq, vdt, off, vb);
      adam_math(k, vector_end, load(param, pdt, off, k, pb), load(grad, gdt, off, k, gb), load(exp_avg, mdt, off, k, mb),
                load(exp_avg_sq, vdt, off, k, vb), po, mo, vo, a);
      store(exp_avg, mdt, off, k, mo);
      store(exp_avg_sq, vdt, off, k, vo);
      store(param, pdt, off, k, po);
      if (weight) store(weight, wdt, off, k, po);
    }
  });
}

// Lion (optim/lion.py): a 16-bit main is rounded after the decay and after the update, as the
// reference's two in-place operations round it.
void lion_step(int64_t n, void* param, int pdt, const void* grad, int gdt, void* exp_avg, int mdt, void* weight,
               int wdt, float decay, int decays, float neg_lr, float w1, float w1m1, int small1, float w2,
               float w2m1, int small2, int threads) {
  const LionScalars a{decay, neg_lr, w1, w1m1, w2, w2m1, small1 != 0, small2 != 0};
  parallel(n, threads, [=](int64_t begin, int64_t end) {
    float pb[BLOCK], gb[BLOCK], mb[BLOCK];
    uint16_t rounded[BLOCK];
    for (int64_t off = begin; off < end; off += BLOCK) {
      int64_t k = std::min(BLOCK, end - off);
      const float* pi = load(param, pdt, off, k, pb);
      float decay = decays ? a.decay : 1.0f;   // x 1 is exact
      if (decays && pdt != 0) {  // the reference stores the decayed 16-bit main before adding the update
        for (int64_t i = 0; i < k; ++i) pb[i] = pi[i] * a.decay;
        store(rounded, pdt, 0, k, pb);
        load(rounded, pdt, 0, k, pb);
        decay = 1.0f;
      }
      float *po = target(param, pdt, off, pb), *mo = target(exp_avg, mdt, off, mb);
      lion_math(k, pi, load(grad, gdt, off, k, gb), load(exp_avg, mdt, off, k, mb), po, mo, decay, a);
      store(exp_avg, mdt, off, k, mo);
      store(param, pdt, off, k, po);
      if (weight) store(weight, wdt, off, k, po);
    }
  });
}

// Adafactor pass 1 over the piece [start, start + n) of a (batches * rows) x cols matrix: row
// sums and per-matrix column sums of g^2 and, when `param` is not null, the per-matrix sum of
// the main's squares (null: the caller has it from the last pass 3, which summed the same
// values in the same order). Outputs are written for the rows and matrices the piece touches
// (callers zero them first).
void adafactor_sums(int64_t start, int64_t n, int64_t rows, int64_t cols, const void* grad, int gdt,
                    const void* param, int pdt, float* row_sums, float* col_sums, float* weight_sq, int threads) {
  Units u(start, n, rows, cols);
  std::vector<double> colp(u.count() * cols, 0.0), wsq(u.count(), 0.0);
  parallel_units(u.count(), n < SERIAL_BELOW ? 1 : threads, [&](int64_t k) {
    float gb[BLOCK], pb[BLOCK];
    std::vector<float> col(cols, 0.0f);  // this unit's column sums (at most ROWS_PER_UNIT terms each)
    double w = 0;
    for (int64_t r = u.row0[k]; r < u.row0[k + 1]; ++r) {
      Lanes row, sq;
      for (int64_t b = u.row_begin(r); b < u.row_end(r); b += BLOCK) {
        int64_t len = std::min(BLOCK, u.row_end(r) - b);
        float* c = col.data() + (b - r * cols);
        const float* g = load(grad, gdt, b - start, len, gb);
        if (param) {
          sums_block(len, g, load(param, pdt, b - start, len, pb), c, row.lane, sq.lane);
        } else {
          grad_sums_block(len, g, c, row.lane);
        }
      }
      row_sums[r] = static_cast<float>(row.total());
      w += sq.total();
    }
    for (int64_t j = 0; j < cols; ++j) colp[k * cols + j] = col[j];
    wsq[k] = w;
  });
  reduce_units(u, colp, cols, col_sums, cols);
  if (param) reduce_units(u, wsq, 1, weight_sq, 1);
}

// The update of element (r, c) of matrix b: g * rsqrt(max(row_var[r] * col_var[b, c] / mean[b], floor)).
#define ADAFACTOR_UPDATE(out, g, r, c0, len, matrix)                                                   \
  {                                                                                                    \
    const float rv = row_var[r], mn = mean[matrix];                                                    \
    const float* cv = col_var + (matrix) * cols + (c0);                                                \
    for (int64_t i = 0; i < (len); ++i) {                                                              \
      float x = rv * cv[i] / mn;                                                                       \
      x = x < floor ? floor : x;                                                                       \
      (out)[i] = 1.0f / std::sqrt(x) * (g)[i];                                                         \
    }                                                                                                  \
  }

// The square of element (r, c)'s update without its square root: g^2 / max(row_var[r] *
// col_var[b, c] / mean[b], floor) (a division where the update takes a root and a division).
#define ADAFACTOR_UPDATE_SQUARED(out, g, r, c0, len, matrix)                                           \
  {                                                                                                    \
    const float rv = row_var[r], mn = mean[matrix];                                                    \
    const float* cv = col_var + (matrix) * cols + (c0);                                                \
    for (int64_t i = 0; i < (len); ++i) {                                                              \
      float x = rv * cv[i] / mn;                                                                       \
      x = x < floor ? floor : x;                                                                       \
      (out)[i] = (g)[i] * (g)[i] / x;                                                                  \
    }                                                                                                  \
  }

// Adafactor pass 2: the per-matrix sum of the update's squares (for the clipping), each square
// as ADAFACTOR_UPDATE_SQUARED computes it (within 2 ulps of the rounded update's square).
void adafactor_update_sums(int64_t start, int64_t n, int64_t rows, int64_t cols, const void* grad, int gdt,
                           const float* row_var, const float* col_var, const float* mean, float floor,
                           float* update_sq, int threads) {
  Units u(start, n, rows, cols);
  std::vector<double> part(u.count(), 0.0);
  parallel_units(u.count(), n < SERIAL_BELOW ? 1 : threads, [&](int64_t k) {
    float gb[BLOCK], up[BLOCK];
    double total = 0;
    for (int64_t r = u.row0[k]; r < u.row0[k + 1]; ++r) {
      Lanes sq;
      for (int64_t b = u.row_begin(r); b < u.row_end(r); b += BLOCK) {
        int64_t len = std::min(BLOCK, u.row_end(r) - b), c0 = b - r * cols;
        const float* g = load(grad, gdt, b - start, len, gb);
        ADAFACTOR_UPDATE_SQUARED(up, g, r, c0, len, r / rows)
        add_block(len, up, sq.lane);
      }
      total += sq.total();
    }
    part[k] = total;
  });
  reduce_units(u, part, 1, update_sq, 1);
}

// Adafactor pass 3: main = main * decay - update * scale[matrix]; `weight` as in adamw_step;
// `weight_sq` (zeroed by the caller): the new main's per-matrix sum of squares, added exactly as
// pass 1 adds the main's, so that the next pass 1 need not read the main.
void adafactor_apply(int64_t start, int64_t n, int64_t rows, int64_t cols, const void* grad, int gdt, void* param,
                     int pdt, void* weight, int wdt, const float* row_var, const float* col_var, const float* mean,
                     float floor, const float* scale, float decay, float* weight_sq, int threads) {
  Units u(start, n, rows, cols);
  std::vector<double> wsq(u.count(), 0.0);
  parallel_units(u.count(), n < SERIAL_BELOW ? 1 : threads, [&](int64_t k) {
    float gb[BLOCK], pb[BLOCK], up[BLOCK];
    double w = 0;
    for (int64_t r = u.row0[k]; r < u.row0[k + 1]; ++r) {
      Lanes sq;
      for (int64_t b = u.row_begin(r); b < u.row_end(r); b += BLOCK) {
        int64_t len = std::min(BLOCK, u.row_end(r) - b), c0 = b - r * cols, matrix = r / rows;
        const float* g = load(grad, gdt, b - start, len, gb);
        const float* pi = load(param, pdt, b - start, len, pb);
        float* po = target(param, pdt, b - start, pb);
        ADAFACTOR_UPDATE(up, g, r, c0, len, matrix)
        const float s = scale[matrix];
        for (int64_t i = 0; i < len; ++i) po[i] = pi[i] * decay - up[i] * s;
        squares_block(len, po, sq.lane);
        store(param, pdt, b - start, len, po);
        if (weight) store(weight, wdt, b - start, len, po);
      }
      w += sq.total();
    }
    wsq[k] = w;
  });
  reduce_units(u, wsq, 1, weight_sq, 1);
}

// The most threads a kernel call on the calling thread ran on since the last read (0: none ran).
int peak_threads() {
  int out = peak;
  peak = 0;
  return out;
}

// A STREAM triad a = b + s * c over n floats (the benchmark's memory bound).
void triad(int64_t n, float* a, const float* b, const float* c, float s, int threads) {
  parallel(n, threads, [=](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) a[i] = b[i] + s * c[i];
  });
}

}  // extern "C"
