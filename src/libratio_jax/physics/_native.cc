// libratio_jax.physics._native: XLA FFI kernels for the CPU (physics/native.py loads them).
//
// Five handlers, none of which holds physics (the formulas stay in the JAX modules):
//   lj_format_counts   a batch of plans' row formats counted per (tenant, row class, format),
//                      the counts batch-last: what rowclasses.format_counts computes in XLA;
//   lj_rows_stability  each row's entry of a [F, M, L] table at the row's format: what
//                      stability.rows_stability computes in XLA;
//   lj_weighted_sums   per-tenant weighted sums of the counts with a table of per-entry terms
//                      (a batched matrix product reading one-byte counts as they are), the
//                      largest of a per-entry table over the entries a plan holds, and
//                      weighted sums of the counts by group of entries;
//   lj_picked_sums     the same sums of classes of one row each read from the plans' formats
//                      (no counts between), and each class's entry of a table of picks;
//   lj_fence           an identity that XLA cannot fuse through, so that a value computed once
//                      per plan is materialized instead of recomputed inside every per-row
//                      kernel that reads it (XLA's CPU pipeline drops optimization barriers
//                      before fusion).
// And one plain Python function, compact(): one host plan's (class, format) entries, what
// rowclasses.compact_entries computes with NumPy (lj.evaluate's single-plan path).
// Each kernel has a scalar path and vector paths for AVX2 and AVX-512 (the best the CPU has
// at or below the cap limit_isa() sets: Isa()), except lj_picked_sums (AVX2 at least).
// Every input is bounds-checked: an out-of-range grid entry reads as padding, a format id
// outside [0, F) is not counted (lj_format_counts) or reads format 0 (lj_rows_stability).
// Built by setup.py (an optional extension: without a compiler the package runs the XLA
// forms); the XLA FFI headers come from jaxlib (jax.ffi.include_dir()).

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <new>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LJ_X86 1
#else
#define LJ_X86 0
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kFormats = 12;         // formats.NUM_FORMATS (native.py checks it)
constexpr uint8_t kNoFormat = 255;   // a padding slot or an id no format has (formats.NO_FORMAT)
constexpr int kTile = 64;            // plans counted side by side, one byte lane each
constexpr int kU8Slots = 255;        // slots counted in 8-bit lanes before widening

// ---------------------------------------------------------------------------------------
// Instruction sets the vector paths use, in order. Each kernel takes the best path the CPU
// has at or below the cap that limit_isa() sets (default: no cap), so that one machine can
// check every path it can run (tests/test_native.py) and a user can compare them; every path
// computes the same results (the sums up to float rounding).
enum IsaLevel : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kVbmi = 3 };
const char* const kIsaNames[] = {"scalar", "avx2", "avx512", "avx512_vbmi"};

int DetectedIsa() {
#if LJ_X86
  static const int level = [] {
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return int(kScalar);
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl"))
      return int(kAvx2);
    return __builtin_cpu_supports("avx512vbmi") ? int(kVbmi) : int(kAvx512);
  }();
  return level;
#else
  return kScalar;
#endif
}

std::atomic<int> g_isa_cap{kVbmi};

int Isa() { return std::min(DetectedIsa(), g_isa_cap.load(std::memory_order_relaxed)); }
bool HasVbmi() { return Isa() >= kVbmi; }
bool HasAvx512() { return Isa() >= kAvx512; }
bool HasAvx2() { return Isa() >= kAvx2; }

#define LJ_AVX2 __attribute__((target("avx2,fma")))

#if LJ_X86
LJ_AVX2 inline __m256i LaneMask8(int n) {  // lanes [0, n) all ones
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The first n (<= 8) lanes stored or loaded (lanes [n, 8) of a load: 0), `mask` their
// LaneMask8: a masked access only for a partial vector (AMD's masked stores are slow).
LJ_AVX2 inline void Store8(float* out, __m256 v, int n, __m256i mask) {
  if (n >= 8) _mm256_storeu_ps(out, v);
  else _mm256_maskstore_ps(out, mask, v);
}

LJ_AVX2 inline __m256 Load8(const float* x, int n, __m256i mask) {
  return n >= 8 ? _mm256_loadu_ps(x) : _mm256_maskload_ps(x, mask);
}

LJ_AVX2 inline __m256i Load8(const int32_t* x, int n, __m256i mask) {
  return n >= 8 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))
                : _mm256_maskload_epi32(x, mask);
}
#endif

// ---------------------------------------------------------------------------------------
// Work split over XLA's intra-op thread pool. Tasks claim chunks from a shared counter; the
// calling thread claims too and then waits only for chunks already claimed by others (a
// task that starts late finds nothing left), so a busy or one-thread pool cannot deadlock
// the call. The state is shared with the tasks, which may outlive the call.
struct SplitState {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

template <typename Fn>
void ParallelChunks(ffi::ThreadPool* pool, int64_t n, Fn fn) {
  int64_t workers = pool ? std::min<int64_t>(pool->num_threads(), n) : 1;
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto state = std::make_shared<SplitState>();
  auto work = [state, n, fn]() {
    for (int64_t i = state->next.fetch_add(1); i < n; i = state->next.fetch_add(1)) {
      fn(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t w = 1; w < workers; ++w) {
    auto task = work;
    pool->Schedule(std::move(task));
  }
  work();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// Transparent huge pages for a large output about to be written (glibc maps allocations
// above its mmap threshold afresh, and each 4 KB page faults on first touch: most of what a
// full-resolution batch's layer_stability cost). Advice only; failures are ignored.
void AdviseHugePages(void* data, size_t bytes) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kHuge = uintptr_t{1} << 21;
  if (bytes < 4 * kHuge) return;
  uintptr_t start = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > start) madvise(reinterpret_cast<void*>(start), end - start, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

// ---------------------------------------------------------------------------------------
// Format counts. Layout: prec u8[B, M, L]; grid s32[M, C, S] (a tenant's row indices per
// class, L = padding); start s32[] (the first plan to count); counts u8 or f32 [M, C, F, k]
// (u8 needs S <= 255: no count can exceed 255; XLA converts them where it reads them, a
// quarter of the bytes to write); complete pred[M, k] (every row of the tenant's classes
// holds an id in [0, F)). Plans start .. start + k - 1 are counted (start clamped to
// [0, B]): a chunk of a batch read where it lies, no copy of its rows; the slots of plans
// past B - 1 are written as plans without rows (counts 0, not complete).

struct Grid {
  int M, C, S, L;
  std::vector<int32_t> rows;  // [M, C, S], out-of-range entries replaced by L
  std::vector<int32_t> size;  // [M, C] real slots
  std::vector<int32_t> span;  // [M] rows to read: 1 + the largest row index used
};

Grid SanitizeGrid(const int32_t* grid, int M, int C, int S, int L) {
  Grid g{M, C, S, L, std::vector<int32_t>(grid, grid + size_t(M) * C * S),
         std::vector<int32_t>(size_t(M) * C, 0), std::vector<int32_t>(M, 0)};
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < C; ++c)
      for (int s = 0; s < S; ++s) {
        int32_t& r = g.rows[(size_t(m) * C + c) * S + s];
        if (r < 0 || r >= L) {
          r = L;
        } else {
          g.size[size_t(m) * C + c] += 1;
          g.span[m] = std::max(g.span[m], r + 1);
        }
      }
  return g;
}

// What a kernel builds from inputs that repeat from call to call (every chunk of a batch, and
// every call on one scenario, passes the same ones) is kept per thread with a byte copy of
// them. SameInputs: whether `parts` ({data, bytes} each, in order) equal the copy in `kept`;
// if not, `kept` becomes their copy and the caller rebuilds (after marking what it keeps
// invalid, so that it stays invalid if the rebuild throws).
struct Part {
  const void* data;
  size_t bytes;
};

bool SameInputs(std::vector<char>& kept, std::initializer_list<Part> parts) {
  size_t total = 0;
  for (const Part& p : parts) total += p.bytes;
  bool same = kept.size() == total;
  size_t at = 0;
  for (const Part& p : parts) {
    if (!same) break;
    same = !p.bytes || std::memcmp(kept.data() + at, p.data, p.bytes) == 0;
    at += p.bytes;
  }
  if (same) return true;
  kept.resize(total);
  at = 0;
  for (const Part& p : parts) {
    if (p.bytes) std::memcpy(kept.data() + at, p.data, p.bytes);
    at += p.bytes;
  }
  return false;
}

// The sanitized grid (~6 µs to sanitize anew on the 2-core machine, ~12 ns per plan of a
// 512-plan chunk). The tasks of a call read the calling thread's copy until the call returns.
const Grid& GridFor(const int32_t* grid, int M, int C, int S, int L) {
  struct Kept {
    std::vector<char> inputs;
    Grid grid{-1, -1, -1, -1, {}, {}, {}};
  };
  thread_local Kept kept;
  const Grid& g = kept.grid;
  const bool same = SameInputs(kept.inputs, {{grid, size_t(M) * C * S * sizeof(int32_t)}});
  if (!same || g.M != M || g.C != C || g.S != S || g.L != L) {
    kept.grid.M = -1;
    kept.grid = SanitizeGrid(grid, M, C, S, L);
  }
  return kept.grid;
}

template <typename T>
void CountScalar(const uint8_t* prec, const Grid& g, int64_t k, int64_t p0, int64_t p1,
                 T* counts, bool* complete) {
  const int M = g.M, C = g.C, S = g.S, L = g.L;
  for (int64_t p = p0; p < p1; ++p)
    for (int m = 0; m < M; ++m) {
      const uint8_t* row = prec + (size_t(p) * M + m) * L;
      bool ok = true;
      for (int c = 0; c < C; ++c) {
        int32_t n[kFormats] = {0};
        const int32_t* slots = g.rows.data() + (size_t(m) * C + c) * S;
        for (int s = 0; s < S; ++s) {
          if (slots[s] >= L) continue;
          unsigned f = row[slots[s]];
          if (f < unsigned(kFormats)) ++n[f]; else ok = false;
        }
        for (int f = 0; f < kFormats; ++f)
          counts[((size_t(m) * C + c) * kFormats + f) * k + p] = T(n[f]);
      }
      complete[size_t(m) * k + p] = ok;
    }
}

#if LJ_X86
#define LJ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi")))

// Index vectors of the 64x64 byte transpose's six stages: stage k swaps bit (5 - k) of the
// row index with the same bit of the column, row i taking its partner i + h's low half of
// each 2h-column block (IDX[k][0]) and the partner its high half (IDX[k][1]). The swaps
// commute, so the stages run in two groups of three on 8 registers at a time.
struct TransposeIndex {
  alignas(64) uint8_t idx[6][2][64];
  TransposeIndex() {
    for (int k = 0; k < 6; ++k) {
      int h = 32 >> k;
      for (int j = 0; j < 64; ++j) {
        int block = j / (2 * h) * (2 * h), t = j % (2 * h);
        idx[k][0][j] = uint8_t(t < h ? block + t : 64 + block + t - h);
        idx[k][1][j] = uint8_t(t < h ? block + h + t : 64 + block + t);
      }
    }
  }
};
const TransposeIndex kTranspose;

LJ_AVX512 inline void ThreeStages(__m512i* x, int first) {
  for (int k = 0; k < 3; ++k) {
    const int d = 4 >> k;  // partner distance among the 8 registers
    const __m512i lo = _mm512_load_si512(kTranspose.idx[first + k][0]);
    const __m512i hi = _mm512_load_si512(kTranspose.idx[first + k][1]);
    for (int i = 0; i < 8; ++i) {
      if (i & d) continue;
      const __m512i a = x[i], c = x[i + d];
      x[i] = _mm512_permutex2var_epi8(a, lo, c);
      x[i + d] = _mm512_permutex2var_epi8(a, hi, c);
    }
  }
}

// dst[i * 64 + j] = src[j * stride + i] for plans j < plans (other lanes kNoFormat) and rows
// i < rows (<= 64); tmp: 4 KB scratch.
LJ_AVX512 void TransposeTile(const uint8_t* src, size_t stride, int plans, int rows,
                             uint8_t* dst, uint8_t* tmp) {
  const __mmask64 cols = rows == 64 ? ~__mmask64{0} : ((__mmask64{1} << rows) - 1);
  const __m512i none = _mm512_set1_epi8(char(kNoFormat));
  for (int g = 0; g < 8; ++g) {  // rows of the tile 8g..8g+7: stages h = 4, 2, 1
    __m512i x[8];
    for (int i = 0; i < 8; ++i) {
      const int j = 8 * g + i;
      // (no mask where every row is read: the note on masks at StabilityRowsAvx512)
      x[i] = j >= plans ? none
             : rows == 64 ? _mm512_loadu_si512(src + size_t(j) * stride)
                          : _mm512_mask_loadu_epi8(none, cols, src + size_t(j) * stride);
    }
    ThreeStages(x, 3);
    for (int i = 0; i < 8; ++i) _mm512_store_si512(tmp + (8 * g + i) * 64, x[i]);
  }
  for (int g = 0; g < 8; ++g) {  // rows g, g+8, ..., g+56: stages h = 32, 16, 8
    __m512i x[8];
    for (int i = 0; i < 8; ++i) x[i] = _mm512_load_si512(tmp + (g + 8 * i) * 64);
    ThreeStages(x, 0);
    for (int i = 0; i < 8; ++i)
      if (g + 8 * i < rows) _mm512_store_si512(dst + (g + 8 * i) * 64, x[i]);
  }
}

// One tile of up to 64 plans starting at p0 (`tile`: its first plan's bytes, [plans, M, L]):
// each tenant's rows transposed into `rows`
// ([L + 1][64], row L all kNoFormat), then each class's slots counted in 8-bit lanes, one
// accumulator per format, widened to float32 every kU8Slots slots.
// The 8-bit accumulators of 64 plans as float32 counts at out[0, plans), added to what is
// there when `add` (a class of more than kU8Slots slots), or as bytes.
LJ_AVX512 inline void StoreCounts(__m512i acc, int plans, bool add, float* out) {
  for (int q = 0; q < 4; ++q) {
    const int n = std::min(16, std::max(0, plans - 16 * q));
    if (!n) break;
    const __mmask16 k = n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    const __m128i bytes =
        _mm512_castsi512_si128(_mm512_maskz_compress_epi64(__mmask8(3u << (2 * q)), acc));
    __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
    if (add) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(k, out + 16 * q));
    _mm512_mask_storeu_ps(out + 16 * q, k, x);
  }
}

LJ_AVX512 inline void StoreCounts(__m512i acc, int plans, bool, uint8_t* out) {
  if (plans == 64) _mm512_storeu_si512(out, acc);  // (no mask: the note at StabilityRowsAvx512)
  else _mm512_mask_storeu_epi8(out, (__mmask64{1} << plans) - 1, acc);
}

template <typename T>
LJ_AVX512 void CountTile(const uint8_t* tile, const Grid& g, int64_t k, int64_t p0, int plans,
                         T* counts, bool* complete, uint8_t* rows, uint8_t* tmp) {
  const int M = g.M, C = g.C, S = g.S, L = g.L;
  __m512i fmt[kFormats];
  for (int f = 0; f < kFormats; ++f) fmt[f] = _mm512_set1_epi8(char(f));
  const __m512i n_formats = _mm512_set1_epi8(char(kFormats));
  const __m512i one = _mm512_set1_epi8(1);
  for (int m = 0; m < M; ++m) {
    const uint8_t* src = tile + size_t(m) * L;
    for (int r0 = 0; r0 < g.span[m]; r0 += 64)
      TransposeTile(src + r0, size_t(M) * L, plans, std::min(64, g.span[m] - r0),
                    rows + size_t(r0) * 64, tmp);
    __mmask64 ok = ~__mmask64{0};
    for (int c = 0; c < C; ++c) {
      const int32_t* slots = g.rows.data() + (size_t(m) * C + c) * S;
      for (int s0 = 0; s0 < S || s0 == 0; s0 += kU8Slots) {
        __m512i acc[kFormats];
        for (int f = 0; f < kFormats; ++f) acc[f] = _mm512_setzero_si512();
        for (int s = s0; s < std::min(S, s0 + kU8Slots); ++s) {
          if (slots[s] >= L) continue;
          const __m512i v = _mm512_load_si512(rows + size_t(slots[s]) * 64);
          ok &= _mm512_cmplt_epu8_mask(v, n_formats);
          for (int f = 0; f < kFormats; ++f)
            acc[f] = _mm512_mask_add_epi8(acc[f], _mm512_cmpeq_epi8_mask(v, fmt[f]), acc[f], one);
        }
        for (int f = 0; f < kFormats; ++f)
          StoreCounts(acc[f], plans, s0 > 0,
                      counts + ((size_t(m) * C + c) * kFormats + f) * k + p0);
        if (S == 0) break;
      }
    }
    // one byte (0 or 1) per plan, one masked store (a scalar loop was ~20% of a tile's time
    // with merged rows)
    _mm512_mask_storeu_epi8(complete + size_t(m) * k + p0,
                            plans == 64 ? ~__mmask64{0} : ((__mmask64{1} << plans) - 1),
                            _mm512_maskz_mov_epi8(ok, one));
  }
}

#endif

#if LJ_X86
// AVX2: 32 plans side by side in byte lanes (kTile2), the rows transposed 16 at a time: plan j's
// 16 bytes and plan j + 16's in the two halves of register j, then a 16x16 byte transpose in
// each half (four rounds of byte interleaves of registers i and i + 8, a perfect shuffle each:
// after four, register i holds row i of plans 0..15 and 16..31), then counted as CountTile
// counts (an id <= 11 compared as min(v, 11) == v: AVX2 has no unsigned byte compare).
constexpr int kTile2 = 32;

LJ_AVX2 void TransposeRows32(const uint8_t* src, size_t stride, uint8_t* dst) {
  __m256i x[16];
  for (int j = 0; j < 16; ++j)
    x[j] = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(src + (j + 16) * stride),
                               reinterpret_cast<const __m128i*>(src + j * stride));
  for (int round = 0; round < 4; ++round) {
    __m256i y[16];
    for (int i = 0; i < 8; ++i) {
      y[2 * i] = _mm256_unpacklo_epi8(x[i], x[i + 8]);
      y[2 * i + 1] = _mm256_unpackhi_epi8(x[i], x[i + 8]);
    }
    for (int i = 0; i < 16; ++i) x[i] = y[i];
  }
  for (int i = 0; i < 16; ++i) _mm256_store_si256(reinterpret_cast<__m256i*>(dst + 32 * i), x[i]);
}

LJ_AVX2 inline void StoreCounts32(__m256i acc, int plans, bool add, float* out) {
  alignas(32) uint8_t bytes[32];
  _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), acc);
  for (int q = 0; q * 8 < plans; ++q) {
    const int n = std::min(8, plans - 8 * q);
    const __m256i mask = LaneMask8(n);
    __m256 x = _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8 * q))));
    if (add) x = _mm256_add_ps(x, Load8(out + 8 * q, n, mask));
    Store8(out + 8 * q, x, n, mask);
  }
}

LJ_AVX2 inline void StoreCounts32(__m256i acc, int plans, bool, uint8_t* out) {
  if (plans == 32) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), acc);
    return;
  }
  alignas(32) uint8_t bytes[32];
  _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), acc);
  std::memcpy(out, bytes, size_t(plans));
}

// One tile of up to 32 plans (`tile`: [32, M, L] bytes and 16 more, plans past `plans` all
// kNoFormat); rows: [L + 16][32] scratch, 32-byte aligned.
template <typename T>
LJ_AVX2 void CountTile32(const uint8_t* tile, const Grid& g, int64_t k, int64_t p0, int plans,
                         T* counts, bool* complete, uint8_t* rows) {
  const int M = g.M, C = g.C, S = g.S, L = g.L;
  const __m256i eleven = _mm256_set1_epi8(char(kFormats - 1));
  const __m256i one = _mm256_set1_epi8(1);
  alignas(32) uint8_t fmt[kFormats][32];
  for (int f = 0; f < kFormats; ++f) std::memset(fmt[f], f, 32);
  for (int m = 0; m < M; ++m) {
    for (int r0 = 0; r0 < g.span[m]; r0 += 16)
      TransposeRows32(tile + size_t(m) * L + r0, size_t(M) * L, rows + size_t(r0) * 32);
    std::memset(rows + size_t(L) * 32, kNoFormat, 32);  // padding (the transposes may pass L)
    __m256i ok = _mm256_set1_epi8(-1);
    for (int c = 0; c < C; ++c) {
      const int32_t* slots = g.rows.data() + (size_t(m) * C + c) * S;
      for (int s0 = 0; s0 < S || s0 == 0; s0 += kU8Slots) {
        __m256i acc[kFormats];
        for (int f = 0; f < kFormats; ++f) acc[f] = _mm256_setzero_si256();
        for (int s = s0; s < std::min(S, s0 + kU8Slots); ++s) {
          if (slots[s] >= L) continue;
          const __m256i v =
              _mm256_load_si256(reinterpret_cast<const __m256i*>(rows + size_t(slots[s]) * 32));
          ok = _mm256_and_si256(ok, _mm256_cmpeq_epi8(_mm256_min_epu8(v, eleven), v));
          for (int f = 0; f < kFormats; ++f)
            acc[f] = _mm256_sub_epi8(
                acc[f], _mm256_cmpeq_epi8(
                            v, _mm256_load_si256(reinterpret_cast<const __m256i*>(fmt[f]))));
        }
        for (int f = 0; f < kFormats; ++f)
          StoreCounts32(acc[f], plans, s0 > 0,
                        counts + ((size_t(m) * C + c) * kFormats + f) * k + p0);
        if (S == 0) break;
      }
    }
    alignas(32) uint8_t held[32];
    _mm256_store_si256(reinterpret_cast<__m256i*>(held), _mm256_and_si256(ok, one));
    std::memcpy(complete + size_t(m) * k + p0, held, size_t(plans));
  }
}
#endif

// Plans 0 .. b - 1 of `p` counted into the slots 0 .. b - 1 of rows k apart, the slots b .. k - 1
// written as plans without rows.
template <typename T>
void CountAll(ffi::ThreadPool& pool, const uint8_t* p, const Grid& g, int64_t b, int64_t k,
              T* n, bool* done) {
  for (int64_t r = 0; r < int64_t(g.M) * g.C * kFormats; ++r)
    std::fill(n + r * k + b, n + (r + 1) * k, T(0));
  for (int m = 0; m < g.M; ++m) std::fill(done + m * k + b, done + (m + 1) * k, false);
#if LJ_X86
  if (HasVbmi()) {
    const int64_t tiles = (b + kTile - 1) / kTile;
    ParallelChunks(tiles > 1 ? &pool : nullptr, tiles, [&, b, k](int64_t t) {
      // per task: the transposed rows of a tenant and the transpose's scratch
      std::vector<uint8_t> buf(size_t(g.L + 1) * 64 + 64 * 64 + 64);
      uint8_t* base = reinterpret_cast<uint8_t*>(
          (reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
      uint8_t* rows = base + 64 * 64;
      std::memset(rows + size_t(g.L) * 64, kNoFormat, 64);
      const int64_t p0 = t * kTile;
      const int plans = int(std::min<int64_t>(kTile, b - p0));
      // The tile's plans copied first, one linear read (~100 KB): the transposes then read
      // 64 plans' rows side by side from cache, where from memory that pattern ran at ~5
      // GB/s (a chunk from memory, 2 threads: ~290 -> ~250 ns per plan; from cache ~+20).
      const size_t bytes = size_t(plans) * g.M * g.L;
      thread_local std::vector<uint8_t> copy;
      if (copy.size() < bytes) copy.resize(bytes);
      std::memcpy(copy.data(), p + size_t(p0) * g.M * g.L, bytes);
      CountTile(copy.data(), g, k, p0, plans, n, done, rows, base);
    });
    return;
  }
  if (HasAvx2()) {
    const int64_t tiles = (b + kTile2 - 1) / kTile2;
    ParallelChunks(tiles > 1 ? &pool : nullptr, tiles, [&, b, k](int64_t t) {
      const int64_t p0 = t * kTile2;
      const int plans = int(std::min<int64_t>(kTile2, b - p0));
      // per thread: the tile's plans copied (as above; plans past the batch: no format, and
      // 16 bytes more for the transposes' last loads) and a tenant's transposed rows
      const size_t plan_bytes = size_t(g.M) * g.L, bytes = size_t(plans) * plan_bytes;
      thread_local std::vector<uint8_t> copy, scratch;
      if (copy.size() < kTile2 * plan_bytes + 16) copy.resize(kTile2 * plan_bytes + 16);
      std::memcpy(copy.data(), p + size_t(p0) * plan_bytes, bytes);
      std::memset(copy.data() + bytes, kNoFormat, kTile2 * plan_bytes + 16 - bytes);
      if (scratch.size() < size_t(g.L + 16) * 32 + 32) scratch.resize(size_t(g.L + 16) * 32 + 32);
      uint8_t* rows = reinterpret_cast<uint8_t*>(
          (reinterpret_cast<uintptr_t>(scratch.data()) + 31) & ~uintptr_t{31});
      CountTile32(copy.data(), g, k, p0, plans, n, done, rows);
    });
    return;
  }
#endif
  CountScalar(p, g, k, 0, b, n, done);
}

ffi::Error FormatCounts(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> prec,
                        ffi::Buffer<ffi::S32> grid, ffi::Buffer<ffi::S32> start,
                        ffi::Result<ffi::AnyBuffer> counts,
                        ffi::ResultBuffer<ffi::PRED> complete) {
  const auto pd = prec.dimensions();
  const auto gd = grid.dimensions();
  const auto cd = counts->dimensions();
  const auto dd = complete->dimensions();
  if (pd.size() != 3 || gd.size() != 3 || cd.size() != 4 || dd.size() != 2 ||
      start.element_count() != 1 || gd[0] != pd[1] || cd[0] != pd[1] || cd[1] != gd[1] ||
      cd[2] != kFormats || dd[0] != cd[0] || dd[1] != cd[3])
    return ffi::Error::InvalidArgument("lj_format_counts: shapes do not match");
  const auto type = counts->element_type();
  if (type != ffi::DataType::F32 && !(type == ffi::DataType::U8 && gd[2] <= kU8Slots))
    return ffi::Error::InvalidArgument(
        "lj_format_counts: counts are float32, or uint8 for at most 255 slots per class");
  const int64_t k = cd[3];
  const int64_t first = std::clamp<int64_t>(start.typed_data()[0], 0, pd[0]);
  const int64_t b = std::clamp<int64_t>(pd[0] - first, 0, k);  // plans to count
  const Grid& g = GridFor(grid.typed_data(), int(gd[0]), int(gd[1]), int(gd[2]), int(pd[2]));
  const uint8_t* p = prec.typed_data() + size_t(first) * pd[1] * pd[2];
  bool* done = complete->typed_data();
  if (type == ffi::DataType::U8)
    CountAll(pool, p, g, b, k, static_cast<uint8_t*>(counts->untyped_data()), done);
  else
    CountAll(pool, p, g, b, k, static_cast<float*>(counts->untyped_data()), done);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------
// Per-row scores. prec u8[B, M, L]; table f32[F, M, L]; keep pred[B, M]; out f32[B, M, L]:
// out[p, m, r] = table[f, m, r] with f the row's id (0 when not in [0, F)), or
// table[fallback, m, r] for a tenant not kept.
//
// A row's column of the table (its F scores) is one of a few per tenant: the scores depend on
// the row's kind and its tenant's mode (stability.row_stability_table), padding rows' are all
// 1. With AVX-512 a batch reads each row's score from its tenant's distinct columns, held in
// registers (at most kLookupEntries scores: columns x F), by its column's offset plus its id:
// one two-table permute per 32 scores, 16 rows at a time. A gather from the [F, M, L] table
// took 2-3x as long (2-core AMD EPYC of family 25, 65,536 reference plans, outputs already
// mapped: ~40-50 -> ~21 ms, where writing the output alone takes ~15 ms: docs/performance.md,
// thirty-fourth round). A tenant with more distinct scores than that is read by the gather.
// With AVX2 (no two-table permute of 16 floats) a batch reads 8 plans' rows at a time from
// the same columns (StabilityColumnsTileAvx2), other tenants by scalar code.

#if LJ_X86
constexpr int kLookupEntries = 256;  // 8 permutes of 32 scores
// Columns a tenant may have at most (a table of 12 formats has at most 21 that fit anyway):
// finding a row's column scans those found so far, so this bounds the cost of a new table
// (a review's table of one format had 256 distinct columns: ~5x the gather's call).
constexpr int kLookupColumns = 32;

// Each tenant's distinct columns of a table [F, M, L]: scores[m] (pairs[m] x 32 floats, the
// columns one after another, F each) and offset[m * L + r] (row r's column's first score);
// pairs[m] == 0 where the tenant's distinct scores would pass kLookupEntries, or its columns
// kLookupColumns.
struct Columns {
  int64_t F = -1, M = -1, L = -1;
  std::vector<int32_t> pairs;                 // [M]
  std::vector<std::vector<float>> scores;     // [M][pairs x 32]
  std::vector<int32_t> offset;                // [M * L]
};

Columns DistinctColumns(const float* table, int64_t F, int64_t M, int64_t L) {
  Columns c;
  c.F = F, c.M = M, c.L = L;
  c.pairs.assign(M, 0);
  c.scores.assign(M, {});
  c.offset.assign(M * L, 0);
  const int64_t plane = M * L;
  std::vector<float> column(F);
  for (int64_t m = 0; m < M; ++m) {
    std::vector<float>& kept = c.scores[m];
    bool fits = F <= kLookupEntries;
    for (int64_t r = 0; r < L && fits; ++r) {
      for (int64_t f = 0; f < F; ++f) column[f] = table[f * plane + m * L + r];
      int64_t at = 0;  // bytes compared: NaNs and signed zeros keep their bits
      while (at < int64_t(kept.size()) &&
             std::memcmp(kept.data() + at, column.data(), F * sizeof(float)) != 0)
        at += F;
      if (at == int64_t(kept.size())) {
        if (at + F > kLookupEntries || at / F >= kLookupColumns) fits = false;
        else kept.insert(kept.end(), column.begin(), column.end());
      }
      c.offset[m * L + r] = int32_t(at);
    }
    if (!fits) {
      kept.clear();
      continue;
    }
    c.pairs[m] = int32_t(std::max<size_t>(1, (kept.size() + 31) / 32));
    // (and 16 more: the AVX2 path reads 16 scores from a column's first)
    kept.resize(std::max<size_t>(size_t(c.pairs[m]) * 32, kept.size() + 16), 0.0f);
  }
  return c;
}

// Kept per thread (SameInputs) with a copy of the table (~76 KB on the reference scenario:
// comparing it ~5 us, building anew ~30 us). The tasks of a call read the calling thread's
// copy until the call returns.
const Columns& ColumnsFor(const float* table, int64_t F, int64_t M, int64_t L) {
  struct Kept {
    std::vector<char> inputs;
    Columns columns;
  };
  thread_local Kept kept;
  const bool same = SameInputs(kept.inputs, {{table, size_t(F * M * L) * sizeof(float)}});
  if (!same || kept.columns.F != F || kept.columns.M != M || kept.columns.L != L) {
    kept.columns.F = -1;
    kept.columns = DistinctColumns(table, F, M, L);
  }
  return kept.columns;
}

// On masks: AVX-512 loads and stores under a mask (even all ones) take ~2x their plain
// forms on an AMD EPYC of family 26 (the forty-second round: one tenant's rows picked from its
// distinct columns, in C alone, 4,096 plans over two threads, output cache-hot: 1.06-1.88 ->
// 0.49-0.92 ms; cold: 1.02-1.97 -> 0.87-1.16 ms), so the rows' kernels below, the sums'
// count loads and stores (SumsAvx512<Full>) and the one-byte counts' tile loads and stores
// (TransposeTile, StoreCounts) use a mask only where a vector is partial. The rows' kernel
// alone (lj_rows_stability on 4,096 full-resolution plans, alternating processes): 1.10-1.68
// -> 0.70-1.15 ms; the whole call with layer_stability ~3.6 -> ~2.8 ms (medians). In the
// counts and sums, no change measurable in a whole call. Still masked on whole vectors: the
// float counts' stores, the counts' `complete` bytes, the merged rows' picked sums.
#define LJ_AVX512_BW __attribute__((target("avx512f,avx512bw,avx512vl")))

LJ_AVX512_BW inline __m512 GatherScores(const float* table, __m512i f, __m512i n_formats,
                                        __m512i stride, int r, __mmask16 k) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  f = _mm512_maskz_mov_epi32(_mm512_cmplt_epu32_mask(f, n_formats), f);
  const __m512i idx = _mm512_add_epi32(_mm512_mullo_epi32(f, stride),
                                       _mm512_add_epi32(lane, _mm512_set1_epi32(r)));
  return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), k, idx, table, 4);
}

LJ_AVX512_BW void StabilityRowsAvx512(const uint8_t* row, const float* table, int64_t plane,
                                      int F, int L, float* out) {
  const __m512i n_formats = _mm512_set1_epi32(F);
  const __m512i stride = _mm512_set1_epi32(int(plane));
  int r = 0;
  for (; r + 16 <= L; r += 16) {
    const __m512i f =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + r)));
    _mm512_storeu_ps(out + r, GatherScores(table, f, n_formats, stride, r, __mmask16(0xFFFF)));
  }
  if (r < L) {
    const __mmask16 k = __mmask16((1u << (L - r)) - 1);
    const __m512i f = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, row + r));
    _mm512_mask_storeu_ps(out + r, k, GatherScores(table, f, n_formats, stride, r, k));
  }
}

// 16 rows' scores from a tenant's distinct columns held in registers (Pairs pairs of 16-float
// halves): format f (format 0 where f is not in [0, F)) of the column starting at `column`.
template <int Pairs>
LJ_AVX512_BW inline __m512 PickScores(const __m512 (&lo)[Pairs], const __m512 (&hi)[Pairs],
                                      __m512i f, __m512i column, __m512i n_formats) {
  f = _mm512_maskz_mov_epi32(_mm512_cmplt_epu32_mask(f, n_formats), f);
  const __m512i idx = _mm512_add_epi32(f, column);
  __m512 v = _mm512_permutex2var_ps(lo[0], idx, hi[0]);
  for (int p = 1; p < Pairs; ++p)  // the pair holding idx (>= 32 p) overrides
    v = _mm512_mask_mov_ps(v, _mm512_cmpge_epi32_mask(idx, _mm512_set1_epi32(32 * p)),
                           _mm512_permutex2var_ps(lo[p], idx, hi[p]));
  return v;
}

// One tenant's rows by its distinct columns (scores: Pairs x 32 floats; offset: [L]).
template <int Pairs>
LJ_AVX512_BW void StabilityColumnsAvx512(const uint8_t* row, const float* scores,
                                         const int32_t* offset, int F, int L, float* out) {
  __m512 lo[Pairs], hi[Pairs];
  for (int p = 0; p < Pairs; ++p) {
    lo[p] = _mm512_loadu_ps(scores + 32 * p);
    hi[p] = _mm512_loadu_ps(scores + 32 * p + 16);
  }
  const __m512i n_formats = _mm512_set1_epi32(F);
  int r = 0;
  for (; r + 16 <= L; r += 16) {
    const __m512i f =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + r)));
    _mm512_storeu_ps(out + r, PickScores<Pairs>(lo, hi, f, _mm512_loadu_si512(offset + r),
                                                n_formats));
  }
  if (r < L) {
    const __mmask16 k = __mmask16((1u << (L - r)) - 1);
    const __m512i f = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, row + r));
    _mm512_mask_storeu_ps(out + r, k,
                          PickScores<Pairs>(lo, hi, f, _mm512_maskz_loadu_epi32(k, offset + r),
                                            n_formats));
  }
}

using ColumnsFn = void (*)(const uint8_t*, const float*, const int32_t*, int, int, float*);
constexpr ColumnsFn kColumnsFns[] = {
    nullptr, StabilityColumnsAvx512<1>, StabilityColumnsAvx512<2>, StabilityColumnsAvx512<3>,
    StabilityColumnsAvx512<4>, StabilityColumnsAvx512<5>, StabilityColumnsAvx512<6>,
    StabilityColumnsAvx512<7>, StabilityColumnsAvx512<8>};
static_assert(sizeof(kColumnsFns) / sizeof(kColumnsFns[0]) == kLookupEntries / 32 + 1);

// A batch of at least this many plans reads its scores by distinct columns (ColumnsFor);
// fewer would not repay comparing the table with the kept copy.
constexpr int64_t kColumnsPlans = 64;

void StabilityColumnsScalar(const uint8_t* row, const float* scores, const int32_t* offset,
                            int F, int L, float* out) {
  for (int r = 0; r < L; ++r) out[r] = scores[offset[r] + (row[r] < unsigned(F) ? row[r] : 0u)];
}

// AVX2, F <= 16: 8 plans (`first`: plan 0's rows of the tenant, the others `stride` bytes
// apart) at a time, 8 rows at a time: their ids transposed to one vector of 8 plans per row,
// each row's scores for the 8 plans two permutes of its column (16 scores from its first) and
// a blend, the 8 x 8 scores transposed back to 8 rows per plan (its outputs `out_stride`
// floats apart). Gathers (one score per lane) and a tree of permutes over all of a tenant's
// scores (8 rows per vector) took longer than scalar code on an AMD EPYC of family 25 model 1.
LJ_AVX2 void StabilityColumnsTileAvx2(const uint8_t* first, size_t stride, const float* scores,
                                      const int32_t* offset, int F, int L, float* out,
                                      size_t out_stride) {
  const __m256i n_formats = _mm256_set1_epi32(F);
  int r0 = 0;
  for (; r0 + 8 <= L; r0 += 8) {
    __m128i a[8];
    for (int j = 0; j < 8; ++j)
      a[j] = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(first + j * stride + r0));
    const __m128i t0 = _mm_unpacklo_epi8(a[0], a[1]), t1 = _mm_unpacklo_epi8(a[2], a[3]),
                  t2 = _mm_unpacklo_epi8(a[4], a[5]), t3 = _mm_unpacklo_epi8(a[6], a[7]);
    const __m128i u0 = _mm_unpacklo_epi16(t0, t1), u1 = _mm_unpackhi_epi16(t0, t1),
                  u2 = _mm_unpacklo_epi16(t2, t3), u3 = _mm_unpackhi_epi16(t2, t3);
    const __m128i by_row[4] = {_mm_unpacklo_epi32(u0, u2), _mm_unpackhi_epi32(u0, u2),
                               _mm_unpacklo_epi32(u1, u3), _mm_unpackhi_epi32(u1, u3)};
    __m256 v[8];  // row i's scores of plans 0..7
    for (int i = 0; i < 8; ++i) {
      __m256i f = _mm256_cvtepu8_epi32(i & 1 ? _mm_srli_si128(by_row[i / 2], 8) : by_row[i / 2]);
      f = _mm256_and_si256(f, _mm256_cmpgt_epi32(n_formats, f));  // not in [0, F): format 0
      const float* column = scores + offset[r0 + i];
      v[i] = _mm256_blendv_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(column), f),
                              _mm256_permutevar8x32_ps(_mm256_loadu_ps(column + 8), f),
                              _mm256_castsi256_ps(_mm256_slli_epi32(f, 28)));
    }
    const __m256 t4 = _mm256_unpacklo_ps(v[0], v[1]), t5 = _mm256_unpackhi_ps(v[0], v[1]),
                 t6 = _mm256_unpacklo_ps(v[2], v[3]), t7 = _mm256_unpackhi_ps(v[2], v[3]),
                 t8 = _mm256_unpacklo_ps(v[4], v[5]), t9 = _mm256_unpackhi_ps(v[4], v[5]),
                 ta = _mm256_unpacklo_ps(v[6], v[7]), tb = _mm256_unpackhi_ps(v[6], v[7]);
    const __m256 s0 = _mm256_shuffle_ps(t4, t6, 0x44), s1 = _mm256_shuffle_ps(t4, t6, 0xEE),
                 s2 = _mm256_shuffle_ps(t5, t7, 0x44), s3 = _mm256_shuffle_ps(t5, t7, 0xEE),
                 s4 = _mm256_shuffle_ps(t8, ta, 0x44), s5 = _mm256_shuffle_ps(t8, ta, 0xEE),
                 s6 = _mm256_shuffle_ps(t9, tb, 0x44), s7 = _mm256_shuffle_ps(t9, tb, 0xEE);
    const __m256 o[8] = {
        _mm256_permute2f128_ps(s0, s4, 0x20), _mm256_permute2f128_ps(s1, s5, 0x20),
        _mm256_permute2f128_ps(s2, s6, 0x20), _mm256_permute2f128_ps(s3, s7, 0x20),
        _mm256_permute2f128_ps(s0, s4, 0x31), _mm256_permute2f128_ps(s1, s5, 0x31),
        _mm256_permute2f128_ps(s2, s6, 0x31), _mm256_permute2f128_ps(s3, s7, 0x31)};
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + j * out_stride + r0, o[j]);
  }
  for (int j = 0; j < 8 && r0 < L; ++j)  // the last rows (fewer than 8)
    StabilityColumnsScalar(first + j * stride + r0, scores, offset + r0, F, L - r0,
                           out + j * out_stride + r0);
}
#endif

void StabilityRowsScalar(const uint8_t* row, const float* table, int64_t plane, int F, int L,
                         float* out) {
  for (int r = 0; r < L; ++r) {
    const unsigned f = row[r] < unsigned(F) ? row[r] : 0u;
    out[r] = table[int64_t(f) * plane + r];
  }
}

ffi::Error RowsStability(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> prec,
                         ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::PRED> keep,
                         ffi::ResultBuffer<ffi::F32> out, int64_t fallback) {
  const auto pd = prec.dimensions();
  const auto td = table.dimensions();
  const auto kd = keep.dimensions();
  if (pd.size() != 3 || td.size() != 3 || kd.size() != 2 || td[1] != pd[1] ||
      td[2] != pd[2] || kd[0] != pd[0] || kd[1] != pd[1] || fallback < 0 || fallback >= td[0])
    return ffi::Error::InvalidArgument("lj_rows_stability: shapes do not match");
  const int64_t B = pd[0], M = pd[1], L = pd[2];
  const int F = int(td[0]);
  const int64_t plane = M * L;
  const uint8_t* p = prec.typed_data();
  const float* t = table.typed_data();
  const bool* k = keep.typed_data();
  float* o = out->typed_data();
  AdviseHugePages(o, size_t(B) * plane * sizeof(float));
  [[maybe_unused]] const int isa =
      plane < (int64_t{1} << 31) / std::max(F, 1) ? Isa() : int(kScalar);
#if LJ_X86
  const Columns* columns = nullptr;
  if (isa >= kAvx2 && B >= kColumnsPlans) {
    try {
      columns = &ColumnsFor(t, F, M, L);
    } catch (const std::bad_alloc&) {  // (its copy of the table or the columns): row by row
      columns = nullptr;
    }
  }
#endif
  constexpr int64_t kPlans = 256;  // plans per task
  ParallelChunks(B > kPlans ? &pool : nullptr, (B + kPlans - 1) / kPlans, [&](int64_t c) {
    const int64_t end = std::min(B, (c + 1) * kPlans);
    int64_t i = c * kPlans;
#if LJ_X86
    if (columns && isa == kAvx2 && F <= 16) {  // 8 plans at a time (the plans not kept after)
      for (; i + 8 <= end; i += 8)
        for (int64_t m = 0; m < M; ++m) {
          bool any = false;  // (a tile none of whose plans is kept is only copied)
          for (int64_t j = i; j < i + 8; ++j) any |= k[j * M + m];
          if (any && columns->pairs[m])
            StabilityColumnsTileAvx2(p + (i * M + m) * L, size_t(M * L),
                                     columns->scores[m].data(), columns->offset.data() + m * L,
                                     F, int(L), o + (i * M + m) * L, size_t(M * L));
          else if (any)
            for (int64_t j = i; j < i + 8; ++j)
              StabilityRowsScalar(p + (j * M + m) * L, t + m * L, plane, F, int(L),
                                  o + (j * M + m) * L);
          for (int64_t j = i; j < i + 8; ++j)
            if (!k[j * M + m])
              std::memcpy(o + (j * M + m) * L, t + fallback * plane + m * L,
                          size_t(L) * sizeof(float));
        }
    }
#endif
    for (; i < end; ++i)
      for (int64_t m = 0; m < M; ++m) {
        float* dst = o + (i * M + m) * L;
        if (!k[i * M + m]) {
          std::memcpy(dst, t + fallback * plane + m * L, size_t(L) * sizeof(float));
          continue;
        }
        const uint8_t* row = p + (i * M + m) * L;
#if LJ_X86
        if (columns && columns->pairs[m]) {
          const ColumnsFn fn =
              isa >= kAvx512 ? kColumnsFns[columns->pairs[m]] : StabilityColumnsScalar;
          fn(row, columns->scores[m].data(), columns->offset.data() + m * L, F, int(L), dst);
          continue;
        }
        if (isa >= kAvx512) {
          StabilityRowsAvx512(row, t + m * L, plane, F, int(L), dst);
          continue;
        }
#endif
        StabilityRowsScalar(row, t + m * L, plane, F, int(L), dst);
      }
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------
// Weighted sums. counts u8 or f32 [M, E, b] (E entries per tenant, plans last: the counts'
// layout); table f32 [M, K, E]; out f32 [M, K, b]:
// out[m, k, p] = sum_e table[m, k, e] * counts[m, e, p]. The counts are read as they are
// (one byte each: no float copy of them for a matrix product).
// With them, the held entries' peak: peaks f32 [M, E]; peak f32 [M, b]:
// peak[m, p] = max(0, max of peaks[m, e] over the entries with counts[m, e, p] > 0);
// and sums by group: weights f32 [M, E], group s32 [M, E]; grouped f32 [M, G, b]:
// grouped[m, g, p] = sum of weights[m, e] * counts[m, e, p] over the entries of group g (an
// entry whose group is not in [0, G) is in none).
// Counts, terms, peaks and weights are finite: an entry that cannot add to a result (every
// term 0, no positive peak, no group or a weight of 0) is skipped. The vector path sums the
// entries group by group (each count read once for the terms, the peak and its group), so
// its float rounding differs from the scalar path's, which sums in the order of e.

constexpr int kSumRows = 8;    // terms per pass (2 x 8 accumulators of 16 plans)
constexpr int kSumPlans = 32;  // plans per task: two vectors of 16

struct SumsArgs {
  const float* table;    // [M, K, E]
  const float* peaks;    // [M, E]
  const float* weights;  // [M, E]
  const int32_t* group;  // [M, E]
  int64_t M, E, K, G, b;
  float* out;      // [M, K, b]
  float* peak;     // [M, b]
  float* grouped;  // [M, G, b]
};

template <typename T>
void SumsScalar(const T* counts, const SumsArgs& a, int64_t m, int64_t p0, int64_t p1) {
  const int64_t E = a.E, K = a.K, G = a.G, b = a.b;
  const T* c = counts + m * E * b;
  for (int64_t k = 0; k < K; ++k)
    for (int64_t p = p0; p < p1; ++p) {
      float acc = 0.0f;
      for (int64_t e = 0; e < E; ++e) acc += a.table[(m * K + k) * E + e] * float(c[e * b + p]);
      a.out[(m * K + k) * b + p] = acc;
    }
  for (int64_t p = p0; p < p1; ++p) {
    float top = 0.0f;
    for (int64_t e = 0; e < E; ++e)
      if (c[e * b + p] > 0) top = std::max(top, a.peaks[m * E + e]);
    a.peak[m * b + p] = top;
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t p = p0; p < p1; ++p) {
      float acc = 0.0f;
      for (int64_t e = 0; e < E; ++e)
        if (a.group[m * E + e] == g) acc += a.weights[m * E + e] * float(c[e * b + p]);
      a.grouped[(m * G + g) * b + p] = acc;
    }
}

// A tenant's entries that can add to a result, in the order the vector path reads them:
// group by group (ascending), then those in no group.
struct HeldEntries {
  std::vector<int32_t> held;     // the entries
  std::vector<float> packed;     // their terms, [passes][held][kSumRows], 0 past the last term
  std::vector<float> peaks;      // their peaks
  std::vector<float> weights;    // their weights in their group (0 for none)
  std::vector<int64_t> group_end;  // [G] the end of each group's entries in `held`
};

HeldEntries Hold(const SumsArgs& a, int64_t m) {
  const int64_t E = a.E, K = a.K, G = a.G;
  const int64_t passes = std::max<int64_t>((K + kSumRows - 1) / kSumRows, 1);
  auto group_of = [&](int64_t e) {  // its group, or G for none
    const int32_t g = a.group[m * E + e];
    return g >= 0 && g < G && a.weights[m * E + e] != 0.0f ? int64_t(g) : G;
  };
  auto adds = [&](int64_t e) {
    bool any = a.peaks[m * E + e] > 0.0f || group_of(e) < G;
    for (int64_t k = 0; k < K && !any; ++k) any = a.table[(m * K + k) * E + e] != 0.0f;
    return any;
  };
  // entries bucketed by group in one pass: counted, offsets, then placed in order
  std::vector<int64_t> start(size_t(G + 2), 0);
  for (int64_t e = 0; e < E; ++e)
    if (adds(e)) ++start[group_of(e) + 1];
  for (int64_t g = 0; g <= G; ++g) start[g + 1] += start[g];
  HeldEntries h;
  const int64_t n = start[G + 1];
  h.held.resize(size_t(n));
  h.group_end.assign(start.begin() + 1, start.begin() + 1 + G);
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t e = 0; e < E; ++e)
    if (adds(e)) h.held[next[group_of(e)]++] = int32_t(e);
  h.packed.assign(size_t(passes * n * kSumRows), 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e = h.held[i];
    for (int64_t k = 0; k < K; ++k)
      h.packed[((k / kSumRows) * n + i) * kSumRows + k % kSumRows] = a.table[(m * K + k) * E + e];
    h.peaks.push_back(a.peaks[m * E + e]);
    h.weights.push_back(group_of(e) < G ? a.weights[m * E + e] : 0.0f);
  }
  return h;
}

#if LJ_X86
// 16 counts as floats: under `mask` (zeros past it), or all 16 with no mask when Full
// (the note on masks at StabilityRowsAvx512).
template <bool Full>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 LoadCounts(
    const uint8_t* x, __mmask16 mask) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
      Full ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(x)) : _mm_maskz_loadu_epi8(mask, x)));
}

template <bool Full>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 LoadCounts(
    const float* x, __mmask16 mask) {
  return Full ? _mm512_loadu_ps(x) : _mm512_maskz_loadu_ps(mask, x);
}

template <bool Full>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void StoreSums(
    float* x, __mmask16 mask, __m512 v) {
  if constexpr (Full) _mm512_storeu_ps(x, v);
  else _mm512_mask_storeu_ps(x, mask, v);
}

// Plans p0 .. p0 + plans - 1 (at most 32) of tenant m: kSumRows terms per pass over its held
// entries; the first pass also takes the peak and each group's sum (the entries come group
// by group), so that each count is read and converted once for all three. Full: kSumPlans
// (every load and store whole, no mask).
template <bool Full, typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void SumsAvx512(
    const T* counts, const SumsArgs& a, const HeldEntries& h, int64_t m, int64_t p0,
    int plans) {
  const int64_t K = a.K, G = a.G, b = a.b, n = int64_t(h.held.size());
  const T* c = counts + m * a.E * b + p0;
  const __mmask16 lo = plans >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << plans) - 1);
  const int hi_n = std::max(0, plans - 16);
  const __mmask16 hi = hi_n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << hi_n) - 1);
  const __m512 zero = _mm512_setzero_ps();
  __m512 top0 = zero, top1 = zero;
  const float* packed = h.packed.data();
  for (int64_t k0 = 0; k0 == 0 || k0 < K; k0 += kSumRows, packed += n * kSumRows) {
    const bool first = k0 == 0;
    __m512 acc[kSumRows][2];
    for (int j = 0; j < kSumRows; ++j) acc[j][0] = acc[j][1] = zero;
    int64_t i = 0;
    for (int64_t g = 0; g <= G; ++g) {  // group g's entries; g == G: those in no group
      const int64_t end = g < G ? h.group_end[g] : n;
      __m512 s0 = zero, s1 = zero;
      for (; i < end; ++i) {
        const int64_t e = h.held[i];
        const __m512 x0 = LoadCounts<Full>(c + e * b, lo);
        const __m512 x1 = LoadCounts<Full>(c + e * b + 16, hi);
        if (first) {
          // max(v, top): top when both are zero, so that a peak of -0.0 leaves +0.0
          const __m512 v = _mm512_set1_ps(h.peaks[i]);
          top0 = _mm512_mask_max_ps(top0, _mm512_cmp_ps_mask(x0, zero, _CMP_GT_OQ), v, top0);
          top1 = _mm512_mask_max_ps(top1, _mm512_cmp_ps_mask(x1, zero, _CMP_GT_OQ), v, top1);
          const __m512 w = _mm512_set1_ps(h.weights[i]);
          s0 = _mm512_fmadd_ps(w, x0, s0);
          s1 = _mm512_fmadd_ps(w, x1, s1);
        }
        const float* t = packed + i * kSumRows;
        for (int j = 0; j < kSumRows; ++j) {
          const __m512 tj = _mm512_set1_ps(t[j]);
          acc[j][0] = _mm512_fmadd_ps(tj, x0, acc[j][0]);
          acc[j][1] = _mm512_fmadd_ps(tj, x1, acc[j][1]);
        }
      }
      if (first && g < G) {
        StoreSums<Full>(a.grouped + (m * G + g) * b + p0, lo, s0);
        StoreSums<Full>(a.grouped + (m * G + g) * b + p0 + 16, hi, s1);
      }
    }
    if (first) {
      StoreSums<Full>(a.peak + m * b + p0, lo, top0);
      StoreSums<Full>(a.peak + m * b + p0 + 16, hi, top1);
    }
    const int64_t left = K - k0;  // terms of this pass (a constant bound keeps acc in registers)
    for (int j = 0; j < kSumRows; ++j) {
      if (j >= left) break;
      StoreSums<Full>(a.out + (m * K + k0 + j) * b + p0, lo, acc[j][0]);
      StoreSums<Full>(a.out + (m * K + k0 + j) * b + p0 + 16, hi, acc[j][1]);
    }
  }
}

// n (<= 8) counts from x as floats, zeros past them; nothing past x + n read.
LJ_AVX2 inline __m256 LoadCounts8(const uint8_t* x, int n, __m256i) {
  uint64_t bytes = 0;
  if (n == 8) std::memcpy(&bytes, x, 8);
  else std::memcpy(&bytes, x, size_t(n));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(bytes))));
}

LJ_AVX2 inline __m256 LoadCounts8(const float* x, int n, __m256i mask) {
  return Load8(x, n, mask);
}

// AVX2: the same as SumsAvx512, 8 plans to a vector, one vector at a time (kSumRows
// accumulators and the count, in 16 registers), the task's plans in runs of 8.
template <typename T>
LJ_AVX2 void SumsAvx2(const T* counts, const SumsArgs& a, const HeldEntries& h, int64_t m,
                      int64_t p0, int plans) {
  const int64_t K = a.K, G = a.G, b = a.b, n = int64_t(h.held.size());
  const __m256 zero = _mm256_setzero_ps();
  // The held entries' counts of these plans first copied as floats, [n][kSumPlans] (~24 KB):
  // read in place, entries b apart, they fell in few cache sets (each read missed L1) and
  // were converted once per pass and run of 8 (a 512-plan chunk: ~370 -> ~306 µs a call in a
  // loop, JAX's dispatch included).
  thread_local std::vector<float> store;
  store.resize(size_t(n) * kSumPlans + 8);
  float* local = reinterpret_cast<float*>(
      (reinterpret_cast<uintptr_t>(store.data()) + 31) & ~uintptr_t{31});
  for (int64_t i = 0; i < n; ++i) {
    const T* src = counts + (m * a.E + h.held[i]) * b + p0;
    for (int v0 = 0; v0 < kSumPlans; v0 += 8) {
      const int live = std::clamp(plans - v0, 0, 8);
      _mm256_store_ps(local + i * kSumPlans + v0,
                      live ? LoadCounts8(src + v0, live, LaneMask8(live)) : zero);
    }
  }
  for (int v0 = 0; v0 < plans; v0 += 8) {
    const int live = std::min(8, plans - v0);
    const __m256i mask = LaneMask8(live);
    const int64_t q0 = p0 + v0;
    __m256 top = zero;
    const float* packed = h.packed.data();
    for (int64_t k0 = 0; k0 == 0 || k0 < K; k0 += kSumRows, packed += n * kSumRows) {
      const bool first = k0 == 0;
      __m256 acc[kSumRows];
      for (int j = 0; j < kSumRows; ++j) acc[j] = zero;
      int64_t i = 0;
      for (int64_t g = 0; g <= G; ++g) {  // group g's entries; g == G: those in no group
        const int64_t end = g < G ? h.group_end[g] : n;
        __m256 s = zero;
        for (; i < end; ++i) {
          const __m256 x = _mm256_load_ps(local + i * kSumPlans + v0);
          if (first) {
            // top where the count is 0, else max(peak, top): a peak of -0.0 leaves +0.0
            const __m256 held = _mm256_cmp_ps(x, zero, _CMP_GT_OQ);
            top = _mm256_blendv_ps(top, _mm256_max_ps(_mm256_set1_ps(h.peaks[i]), top), held);
            s = _mm256_fmadd_ps(_mm256_set1_ps(h.weights[i]), x, s);
          }
          const float* t = packed + i * kSumRows;
          for (int j = 0; j < kSumRows; ++j)
            acc[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(t + j), x, acc[j]);
        }
        if (first && g < G) Store8(a.grouped + (m * G + g) * b + q0, s, live, mask);
      }
      if (first) Store8(a.peak + m * b + q0, top, live, mask);
      const int64_t left = K - k0;
      for (int j = 0; j < kSumRows; ++j) {
        if (j >= left) break;
        Store8(a.out + (m * K + k0 + j) * b + q0, acc[j], live, mask);
      }
    }
  }
}
#endif

// Each tenant's held entries for the vector path, kept per thread (SameInputs) with its
// table, peaks, weights and groups (~25 µs to hold anew on the 2-core machine, ~50 ns per plan
// of a 512-plan chunk; comparing them ~1 µs). The tasks of a call read the calling thread's
// copy until the call returns.
const std::vector<HeldEntries>& HeldFor(const SumsArgs& a) {
  struct Kept {
    int64_t M = -1, E = -1, K = -1, G = -1;
    std::vector<char> inputs;
    std::vector<HeldEntries> held;
  };
  thread_local Kept kept;
  const size_t entries = size_t(a.M * a.E);
  const bool same = SameInputs(kept.inputs, {{a.table, entries * a.K * sizeof(float)},
                                             {a.peaks, entries * sizeof(float)},
                                             {a.weights, entries * sizeof(float)},
                                             {a.group, entries * sizeof(int32_t)}});
  if (!same || kept.M != a.M || kept.E != a.E || kept.K != a.K || kept.G != a.G) {
    kept.M = -1;
    kept.held.clear();
    for (int64_t m = 0; m < a.M; ++m) kept.held.push_back(Hold(a, m));
    kept.M = a.M, kept.E = a.E, kept.K = a.K, kept.G = a.G;
  }
  return kept.held;
}

template <typename T>
void SumsAll(ffi::ThreadPool& pool, const T* counts, const SumsArgs& a) {
  const int64_t tiles = (a.b + kSumPlans - 1) / kSumPlans;
  const int isa = Isa();
  static const std::vector<HeldEntries> kNone;
  const std::vector<HeldEntries>& held = isa >= kAvx2 ? HeldFor(a) : kNone;
  ParallelChunks(a.M * tiles > 1 ? &pool : nullptr, a.M * tiles, [&](int64_t task) {
    const int64_t m = task / tiles, p0 = (task % tiles) * kSumPlans;
    const int plans = int(std::min<int64_t>(kSumPlans, a.b - p0));
#if LJ_X86
    if (isa >= kAvx512) {
      if (plans == kSumPlans) SumsAvx512<true>(counts, a, held[m], m, p0, plans);
      else SumsAvx512<false>(counts, a, held[m], m, p0, plans);
      return;
    }
    if (isa >= kAvx2) {
      SumsAvx2(counts, a, held[m], m, p0, plans);
      return;
    }
#endif
    SumsScalar(counts, a, m, p0, p0 + plans);
  });
}

ffi::Error WeightedSums(ffi::ThreadPool pool, ffi::AnyBuffer counts, ffi::Buffer<ffi::F32> table,
                        ffi::Buffer<ffi::F32> peaks, ffi::Buffer<ffi::F32> weights,
                        ffi::Buffer<ffi::S32> group, ffi::ResultBuffer<ffi::F32> out,
                        ffi::ResultBuffer<ffi::F32> peak, ffi::ResultBuffer<ffi::F32> grouped) {
  const auto cd = counts.dimensions();
  const auto td = table.dimensions();
  const auto vd = peaks.dimensions();
  const auto wd = weights.dimensions();
  const auto gd = group.dimensions();
  const auto od = out->dimensions();
  const auto pd = peak->dimensions();
  const auto sd = grouped->dimensions();
  if (cd.size() != 3 || td.size() != 3 || od.size() != 3 || vd.size() != 2 || pd.size() != 2 ||
      wd.size() != 2 || gd.size() != 2 || sd.size() != 3)
    return ffi::Error::InvalidArgument("lj_weighted_sums: ranks do not match");
  const int64_t M = cd[0], E = cd[1], b = cd[2], K = td[1], G = sd[1];
  if (td[0] != M || td[2] != E || od[0] != M || od[1] != K || od[2] != b || vd[0] != M ||
      vd[1] != E || pd[0] != M || pd[1] != b || wd[0] != M || wd[1] != E || gd[0] != M ||
      gd[1] != E || sd[0] != M || sd[2] != b)
    return ffi::Error::InvalidArgument("lj_weighted_sums: shapes do not match");
  const SumsArgs a{table.typed_data(), peaks.typed_data(), weights.typed_data(),
                   group.typed_data(), M, E, K, G, b, out->typed_data(), peak->typed_data(),
                   grouped->typed_data()};
  if (counts.element_type() == ffi::DataType::U8)
    SumsAll(pool, static_cast<const uint8_t*>(counts.untyped_data()), a);
  else if (counts.element_type() == ffi::DataType::F32)
    SumsAll(pool, static_cast<const float*>(counts.untyped_data()), a);
  else
    return ffi::Error::InvalidArgument("lj_weighted_sums: counts are uint8 or float32");
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------
// Picked sums: lj_weighted_sums of classes of one row each (merged rows, every row a class of
// its own: rowclasses.own_classes) read from the plans' ids, with no counts between. Such a
// class holds one entry, its row's format, so a plan's sums add that entry's terms: 14 rows
// read per tenant where the counts are 16 x 12 entries written and read again. Layout: prec
// u8[B, M, L]; grid s32[M, C, 1] (each class's row; out of [0, L): padding); start s32[];
// table f32[M, K, E], peaks f32[M, E], weights f32[M, E], group s32[M, E] (lj_weighted_sums'),
// picks f32[M, J, E] (E = C x F, entry c x F + f). Results for plans start .. start + k - 1
// (start clamped to [0, B]): sums f32[M, K, k], peak f32[M, k], grouped f32[M, G, k] (what
// lj_weighted_sums gives of those plans' counts), picked f32[M, J, C, k] (each class's entry
// of picks; 0 for a padding class or a row whose id is not in [0, F)), complete pred[M, k]
// (lj_format_counts'). Plans past B - 1: zeros, not complete. Vector paths only (AVX2 at
// least; native.py's status says so). AVX-512: 16 plans to a vector, a class's entry of a
// field for 16 plans one permute of the field's column over the formats (F <= 16) by their
// ids, so each (field, class) costs a permute and an add per 16 plans, written batch-last as
// it comes; AVX2: 8 plans to a vector, two permutes and a blend (PickTile2).

constexpr int kPickPlans = 64;  // plans per task: 4 vectors of 16
constexpr int kLanes = 16;
static_assert(kFormats <= kLanes, "a field's column over the formats is one vector");

struct PickArgs {
  const uint8_t* prec;  // the first plan's rows
  int64_t M, L, C, K, J, G, b, k;  // b: plans in the batch from the first on; k: results
  float* sums;
  float* peak;
  float* grouped;
  float* picked;
  bool* complete;
};

// Per (tenant, class) each field over the formats as a column of 16 floats (formats 0 .. F - 1,
// then zeros), for: the K terms and G groups summed (a group's column: the entry's weight where
// the entry is in the group; columns of zeros left out), the J picks and the peak. Kept per
// thread with a copy of their inputs (SameInputs), as HeldFor keeps its entries; the tasks of
// a call read the calling thread's copy until the call returns.
struct PickTable {
  int64_t M = -1, C = -1, K = -1, J = -1, G = -1, L = -1;
  std::vector<int32_t> row;        // [M, C]: each class's row, -1 for padding
  std::vector<float> store;        // the columns (and room to align them)
  const float* column = nullptr;   // 16-float slots, 64-byte aligned, in store
  std::vector<int32_t> sum_start;  // [M, K + G + 1]: each sum's range of (class, slot) pairs
  std::vector<int32_t> sum_class, sum_slot;
  std::vector<int32_t> pick_slot;  // [M, J, C]; -1 for a padding class (zeros)
  std::vector<int32_t> peak_slot;  // [M, C]; -1 for a padding class
};

const PickTable& PickTableFor(const int32_t* grid, const float* table, const float* peaks,
                              const float* weights, const int32_t* group, const float* picks,
                              int64_t M, int64_t C, int64_t K, int64_t J, int64_t G,
                              int64_t L) {
  struct Kept {
    std::vector<char> inputs;
    PickTable t;
  };
  thread_local Kept kept;
  PickTable& t = kept.t;
  const int64_t E = C * kFormats;
  const size_t n = size_t(M * E);
  const bool same = SameInputs(kept.inputs, {{grid, size_t(M * C) * sizeof(int32_t)},
                                             {table, n * K * sizeof(float)},
                                             {peaks, n * sizeof(float)},
                                             {weights, n * sizeof(float)},
                                             {group, n * sizeof(int32_t)},
                                             {picks, n * J * sizeof(float)}});
  if (same && t.M == M && t.C == C && t.K == K && t.J == J && t.G == G && t.L == L) return t;
  t.M = -1;
  // field q of entry (m, e): a term, a group's weight, a pick, the peak
  auto value = [&](int64_t m, int64_t e, int64_t q) -> float {
    if (q < K) return table[(m * K + q) * E + e];
    if (q < K + G) return group[m * E + e] == q - K ? weights[m * E + e] : 0.0f;
    if (q < K + G + J) return picks[(m * J + q - K - G) * E + e];
    return peaks[m * E + e];
  };
  std::vector<float> columns;
  auto add = [&](int64_t m, int64_t c, int64_t q) -> int32_t {
    const int32_t slot = int32_t(columns.size() / kLanes);
    columns.resize(columns.size() + kLanes, 0.0f);
    for (int64_t f = 0; f < kFormats; ++f) columns[slot * kLanes + f] = value(m, c * kFormats + f, q);
    return slot;
  };
  const int64_t Q = K + G;
  t.row.assign(size_t(M * C), -1);
  t.sum_start.assign(size_t(M * (Q + 1)), 0);
  t.sum_class.clear();
  t.sum_slot.clear();
  t.pick_slot.assign(size_t(M * J * C), -1);
  t.peak_slot.assign(size_t(M * C), -1);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t c = 0; c < C; ++c) {
      const int32_t r = grid[m * C + c];
      t.row[m * C + c] = r >= 0 && r < L ? r : -1;
    }
    for (int64_t q = 0; q < Q; ++q) {
      t.sum_start[m * (Q + 1) + q] = int32_t(t.sum_class.size());
      for (int64_t c = 0; c < C; ++c) {
        bool nonzero = false;
        for (int64_t f = 0; f < kFormats; ++f) nonzero |= value(m, c * kFormats + f, q) != 0.0f;
        if (t.row[m * C + c] < 0 || !nonzero) continue;
        t.sum_class.push_back(int32_t(c));
        t.sum_slot.push_back(add(m, c, q));
      }
    }
    t.sum_start[m * (Q + 1) + Q] = int32_t(t.sum_class.size());
    for (int64_t c = 0; c < C; ++c) {
      if (t.row[m * C + c] < 0) continue;
      for (int64_t j = 0; j < J; ++j) t.pick_slot[(m * J + j) * C + c] = add(m, c, Q + j);
      t.peak_slot[m * C + c] = add(m, c, Q + J);
    }
  }
  t.store.assign(columns.size() + kLanes, 0.0f);
  const uintptr_t base = reinterpret_cast<uintptr_t>(t.store.data());
  float* aligned = reinterpret_cast<float*>((base + 63) & ~uintptr_t(63));
  std::copy(columns.begin(), columns.end(), aligned);
  t.column = aligned;
  t.M = M, t.C = C, t.K = K, t.J = J, t.G = G, t.L = L;
  return t;
}

#if LJ_X86
// The rows (L <= 16 bytes each) of 16 plans `stride` bytes apart, the first `live` read (the
// others: no format), transposed to by_row[r * 16 + i] = row r of plan i (rows L .. 15: no
// format): the rows stored side by side, then each output byte picked from them with two
// two-table byte permutes (VBMI).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi")))
void TransposeRows16(const uint8_t* first, int64_t stride, int64_t L, int live, uint8_t* by_row) {
  alignas(64) uint8_t by_plan[16 * 16];  // [plan, row]
  const __mmask16 row_mask = __mmask16((uint32_t(1) << L) - 1);
  const __m128i none = _mm_set1_epi8(char(kNoFormat));
  for (int i = 0; i < 16; ++i)
    _mm_store_si128(reinterpret_cast<__m128i*>(by_plan + 16 * i),
                    i < live ? _mm_mask_loadu_epi8(none, row_mask, first + i * stride) : none);
  static const struct Index {  // output byte b of vector o: row 4 o + b / 16 of plan b % 16
    alignas(64) uint8_t at[4][64];  // its byte among the first or the last two inputs
    uint64_t high[4] = {0, 0, 0, 0};  // whether among the last two
    Index() {
      for (int o = 0; o < 4; ++o)
        for (int b = 0; b < 64; ++b) {
          const int src = (b % 16) * 16 + 4 * o + b / 16;
          at[o][b] = uint8_t(src % 128);
          if (src >= 128) high[o] |= uint64_t(1) << b;
        }
    }
  } index;
  const __m512i in0 = _mm512_load_si512(by_plan), in1 = _mm512_load_si512(by_plan + 64),
                in2 = _mm512_load_si512(by_plan + 128), in3 = _mm512_load_si512(by_plan + 192);
  for (int o = 0; o < 4; ++o) {
    const __m512i at = _mm512_load_si512(index.at[o]);
    const __m512i lo = _mm512_permutex2var_epi8(in0, at, in1);
    const __m512i hi = _mm512_permutex2var_epi8(in2, at, in3);
    _mm512_store_si512(by_row + 64 * o, _mm512_mask_blend_epi8(index.high[o], lo, hi));
  }
}

// One task: plans p0 .. p1 - 1 (at most kPickPlans), tenant by tenant. The ids are first laid
// out class by class as int32 (16 plans' rows transposed at once with VBMI when a tenant has at
// most 16 rows, else byte by byte), then each sum runs over its classes, then the picks and
// the peak class by class.
__attribute__((target("avx512f,avx512bw,avx512vl")))
void PickTile(const PickArgs& a, const PickTable& t, int64_t p0, int64_t p1) {
  constexpr int kVectors = kPickPlans / kLanes;
  const int64_t M = a.M, L = a.L, C = a.C, J = a.J, K = a.K, G = a.G, Q = K + G, k = a.k;
  const int64_t n = p1 - p0, vectors = (n + kLanes - 1) / kLanes;
  const int64_t live_plans = std::clamp<int64_t>(a.b - p0, 0, n);  // the others: past B - 1
  thread_local std::vector<int32_t> ids_store;  // [C, kPickPlans]
  thread_local std::vector<__mmask16> held_store;  // [C, kVectors]: an id in [0, F)
  ids_store.resize(size_t(C * kPickPlans));
  held_store.resize(size_t(C * kVectors));
  int32_t* ids = ids_store.data();
  __mmask16* held = held_store.data();
  __mmask16 store[kVectors], complete[kVectors];
  for (int v = 0; v < kVectors; ++v) {
    const int64_t left = std::clamp<int64_t>(n - v * kLanes, 0, kLanes);
    store[v] = __mmask16((uint32_t(1) << left) - 1);
  }
  const __m512i n_formats = _mm512_set1_epi32(kFormats);
  const bool vbmi = L <= 16 && HasVbmi();
  for (int64_t m = 0; m < M; ++m) {
    const int32_t* rows = t.row.data() + m * C;
    if (vbmi) {
      alignas(64) uint8_t by_row[16 * kLanes];  // [row, plan]
      for (int64_t v = 0; v < vectors; ++v) {
        const int64_t live = std::clamp<int64_t>(live_plans - v * kLanes, 0, kLanes);
        const uint8_t* first = live ? a.prec + ((p0 + v * kLanes) * M + m) * L : a.prec;
        TransposeRows16(first, M * L, L, int(live), by_row);
        for (int64_t c = 0; c < C; ++c)
          _mm512_storeu_si512(ids + c * kPickPlans + v * kLanes,
                              rows[c] >= 0 ? _mm512_cvtepu8_epi32(_mm_load_si128(
                                                 reinterpret_cast<const __m128i*>(
                                                     by_row + rows[c] * kLanes)))
                                           : _mm512_set1_epi32(kNoFormat));
      }
    } else {
      for (int64_t i = 0; i < vectors * kLanes; ++i) {
        const uint8_t* id = i < live_plans ? a.prec + ((p0 + i) * M + m) * L : nullptr;
        for (int64_t c = 0; c < C; ++c)
          ids[c * kPickPlans + i] = id && rows[c] >= 0 ? id[rows[c]] : kNoFormat;
      }
    }
    for (int64_t v = 0; v < vectors; ++v) {
      const int64_t live = std::clamp<int64_t>(live_plans - v * kLanes, 0, kLanes);
      complete[v] = __mmask16((uint32_t(1) << live) - 1);
      for (int64_t c = 0; c < C; ++c) {
        const __m512i f = _mm512_loadu_si512(ids + c * kPickPlans + v * kLanes);
        held[c * kVectors + v] = _mm512_cmplt_epu32_mask(f, n_formats);
        if (rows[c] >= 0) complete[v] &= held[c * kVectors + v];
      }
    }
    const int32_t* range = t.sum_start.data() + m * (Q + 1);
    for (int64_t q = 0; q < Q; ++q) {  // the terms, then the groups
      __m512 acc[kVectors];
      for (int v = 0; v < kVectors; ++v) acc[v] = _mm512_setzero_ps();
      for (int32_t s = range[q]; s < range[q + 1]; ++s) {
        const int32_t c = t.sum_class[s];
        const __m512 column = _mm512_load_ps(t.column + kLanes * int64_t(t.sum_slot[s]));
        for (int64_t v = 0; v < vectors; ++v) {
          const __m512i f = _mm512_loadu_si512(ids + c * kPickPlans + v * kLanes);
          acc[v] = _mm512_mask_add_ps(acc[v], held[c * kVectors + v], acc[v],
                                      _mm512_permutexvar_ps(f, column));
        }
      }
      float* out = q < K ? a.sums + (m * K + q) * k : a.grouped + (m * G + q - K) * k;
      for (int64_t v = 0; v < vectors; ++v)
        _mm512_mask_storeu_ps(out + p0 + v * kLanes, store[v], acc[v]);
    }
    __m512 top[kVectors];
    for (int v = 0; v < kVectors; ++v) top[v] = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; ++c) {
      for (int64_t j = 0; j < J; ++j) {
        const int32_t slot = t.pick_slot[(m * J + j) * C + c];
        const __m512 column = slot < 0 ? _mm512_setzero_ps()
                                       : _mm512_load_ps(t.column + kLanes * int64_t(slot));
        float* out = a.picked + ((m * J + j) * C + c) * k + p0;
        for (int64_t v = 0; v < vectors; ++v) {
          const __m512i f = _mm512_loadu_si512(ids + c * kPickPlans + v * kLanes);
          _mm512_mask_storeu_ps(out + v * kLanes, store[v],
                                _mm512_maskz_permutexvar_ps(held[c * kVectors + v], f, column));
        }
      }
      const int32_t slot = t.peak_slot[m * C + c];
      if (slot < 0) continue;
      const __m512 column = _mm512_load_ps(t.column + kLanes * int64_t(slot));
      for (int64_t v = 0; v < vectors; ++v) {
        const __m512i f = _mm512_loadu_si512(ids + c * kPickPlans + v * kLanes);
        // max(x, top): top when both are zero, so that a peak of -0.0 leaves +0.0
        top[v] = _mm512_mask_max_ps(top[v], held[c * kVectors + v],
                                    _mm512_permutexvar_ps(f, column), top[v]);
      }
    }
    for (int64_t v = 0; v < vectors; ++v) {
      _mm512_mask_storeu_ps(a.peak + m * k + p0 + v * kLanes, store[v], top[v]);
      _mm_mask_storeu_epi8(a.complete + m * k + p0 + v * kLanes, store[v],
                           _mm_maskz_set1_epi8(complete[v], 1));
    }
  }
}
#endif

#if LJ_X86
// A column's entries (16 floats, 32-byte aligned) at 8 plans' ids (`ids`: as PickTile2 keeps
// them, below).
LJ_AVX2 inline __m256 Lookup16(const float* column, const int32_t* ids) {
  const __m256i g = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ids));
  const __m256 lo = _mm256_permutevar8x32_ps(_mm256_load_ps(column), g);
  const __m256 hi = _mm256_permutevar8x32_ps(_mm256_load_ps(column + 8), g);
  return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(g));
}

// AVX2: PickTile with 8 plans to a vector (Full: a whole tile, the loops' bounds constant). A
// field's column over the formats is two vectors (formats 0..7 and 8..15); an id is kept as
// g = f | f << 28 (f: the id, or 15 for an id not in [0, F) or no row: column slot 15 is 0, so
// such a class adds nothing and picks 0), whose low 3 bits pick within each vector and whose
// sign bit (f's bit 3) picks the vector.
template <bool Full>
LJ_AVX2 void PickTile2(const PickArgs& a, const PickTable& t, int64_t p0, int64_t p1) {
  constexpr int kVectors = kPickPlans / 8;
  constexpr int32_t kNone = 15;  // column slot 15: 0 in every column (kFormats <= 15)
  static_assert(kFormats < kNone, "slot 15 of a column holds no format");
  const int64_t M = a.M, L = a.L, C = a.C, J = a.J, K = a.K, G = a.G, Q = K + G, k = a.k;
  const int64_t n = Full ? kPickPlans : p1 - p0, vectors = Full ? kVectors : (n + 7) / 8;
  const int64_t live_plans = std::clamp<int64_t>(a.b - p0, 0, n);  // the others: past B - 1
  thread_local std::vector<int32_t> ids_store;  // [C, kPickPlans]
  ids_store.resize(size_t(C * kPickPlans));
  int32_t* ids = ids_store.data();
  __m256i store[kVectors];
  int lanes[kVectors];
  for (int v = 0; v < kVectors; ++v) {
    lanes[v] = int(std::clamp<int64_t>(n - 8 * v, 0, 8));
    store[v] = LaneMask8(lanes[v]);
  }
  // Tenants of at most 16 rows: the tile's plans copied (plans past the batch: no format; 16
  // bytes more for the last loads), each tenant's rows transposed 32 plans at a time
  // (TransposeRows32), a class's ids of 8 plans then one load (the ids read byte by byte
  // were ~30% of the kernel's time).
  const bool transpose = L <= 16;
  const size_t plan_bytes = size_t(M * L);
  thread_local std::vector<uint8_t> copy;
  if (transpose) {
    copy.resize(kPickPlans * plan_bytes + 16);
    std::memcpy(copy.data(), a.prec + size_t(p0) * plan_bytes, size_t(live_plans) * plan_bytes);
    std::memset(copy.data() + size_t(live_plans) * plan_bytes, kNoFormat,
                (kPickPlans - size_t(live_plans)) * plan_bytes + 16);
  }
  alignas(32) uint8_t by_row[2][16 * 32];  // [plans 0..31, 32..63][row][plan]
  alignas(32) int32_t held[kPickPlans];
  const __m256i none = _mm256_set1_epi32(kNone | kNone << 28);
  const __m256i n_formats = _mm256_set1_epi32(kFormats);
  for (int64_t m = 0; m < M; ++m) {
    const int32_t* rows = t.row.data() + m * C;
    __m256i complete[kVectors];
    for (int v = 0; v < kVectors; ++v)
      complete[v] = LaneMask8(int(std::clamp<int64_t>(live_plans - 8 * v, 0, 8)));
    if (transpose) {
      TransposeRows32(copy.data() + m * L, plan_bytes, by_row[0]);
      TransposeRows32(copy.data() + (32 * M + m) * L, plan_bytes, by_row[1]);
      for (int64_t c = 0; c < C; ++c) {
        int32_t* out = ids + c * kPickPlans;
        for (int64_t v = 0; v < vectors; ++v) {
          if (rows[c] < 0) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8 * v), none);
            continue;
          }
          const __m256i f = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(
              by_row[v / 4] + 32 * rows[c] + 8 * (v % 4))));
          const __m256i valid = _mm256_cmpgt_epi32(n_formats, f);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8 * v),
                              _mm256_blendv_epi8(none, _mm256_or_si256(f, _mm256_slli_epi32(f, 28)),
                                                 valid));
          complete[v] = _mm256_and_si256(complete[v], valid);
        }
      }
    } else {
      for (int64_t i = 0; i < kPickPlans; ++i) held[i] = -1;
      for (int64_t c = 0; c < C; ++c)
        for (int64_t i = 0; i < vectors * 8; ++i) {
          int32_t f = kNone;
          if (i < live_plans && rows[c] >= 0) {
            const uint8_t id = a.prec[((p0 + i) * M + m) * L + rows[c]];
            if (id < kFormats) f = id;
            else held[i] = 0;
          }
          ids[c * kPickPlans + i] = f | f << 28;
        }
      for (int64_t v = 0; v < vectors; ++v)
        complete[v] = _mm256_and_si256(
            complete[v], _mm256_load_si256(reinterpret_cast<const __m256i*>(held + 8 * v)));
    }
    const int32_t* range = t.sum_start.data() + m * (Q + 1);
    for (int64_t q = 0; q < Q; ++q) {  // the terms, then the groups
      __m256 acc[kVectors];
      for (int v = 0; v < kVectors; ++v) acc[v] = _mm256_setzero_ps();
      for (int32_t s = range[q]; s < range[q + 1]; ++s) {
        const int32_t* g = ids + t.sum_class[s] * kPickPlans;
        const float* column = t.column + kLanes * int64_t(t.sum_slot[s]);
        for (int64_t v = 0; v < vectors; ++v)
          acc[v] = _mm256_add_ps(acc[v], Lookup16(column, g + 8 * v));
      }
      float* out = q < K ? a.sums + (m * K + q) * k : a.grouped + (m * G + q - K) * k;
      for (int64_t v = 0; v < vectors; ++v) Store8(out + p0 + 8 * v, acc[v], lanes[v], store[v]);
    }
    __m256 top[kVectors];
    for (int v = 0; v < kVectors; ++v) top[v] = _mm256_setzero_ps();
    for (int64_t c = 0; c < C; ++c) {
      const int32_t* g = ids + c * kPickPlans;
      for (int64_t j = 0; j < J; ++j) {
        const int32_t slot = t.pick_slot[(m * J + j) * C + c];
        float* out = a.picked + ((m * J + j) * C + c) * k + p0;
        for (int64_t v = 0; v < vectors; ++v)
          Store8(out + 8 * v,
                 slot < 0 ? _mm256_setzero_ps()
                          : Lookup16(t.column + kLanes * int64_t(slot), g + 8 * v),
                 lanes[v], store[v]);
      }
      const int32_t slot = t.peak_slot[m * C + c];
      if (slot < 0) continue;
      for (int64_t v = 0; v < vectors; ++v)  // max(x, top): top when both are zero (as above)
        top[v] = _mm256_max_ps(Lookup16(t.column + kLanes * int64_t(slot), g + 8 * v), top[v]);
    }
    for (int64_t v = 0; v < vectors; ++v) {
      Store8(a.peak + m * k + p0 + 8 * v, top[v], lanes[v], store[v]);
      const int bits = _mm256_movemask_ps(_mm256_castsi256_ps(complete[v]));
      for (int i = 0; i < lanes[v]; ++i) a.complete[m * k + p0 + 8 * v + i] = (bits >> i) & 1;
    }
  }
}
#endif

ffi::Error PickedSums(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> prec, ffi::Buffer<ffi::S32> grid,
                      ffi::Buffer<ffi::S32> start, ffi::Buffer<ffi::F32> table,
                      ffi::Buffer<ffi::F32> peaks, ffi::Buffer<ffi::F32> weights,
                      ffi::Buffer<ffi::S32> group, ffi::Buffer<ffi::F32> picks,
                      ffi::ResultBuffer<ffi::F32> sums, ffi::ResultBuffer<ffi::F32> peak,
                      ffi::ResultBuffer<ffi::F32> grouped, ffi::ResultBuffer<ffi::F32> picked,
                      ffi::ResultBuffer<ffi::PRED> complete) {
#if LJ_X86
  // No scalar path: a cap below AVX2 set after native.py's status turned this kernel on
  // leaves it on AVX2 (status reads the cap once; LIBRATIO_NATIVE_ISA=scalar runs XLA's form).
  if (DetectedIsa() < kAvx2) return ffi::Error::InvalidArgument("lj_picked_sums: needs AVX2");
  const int isa = std::max(Isa(), int(kAvx2));
  const auto pd = prec.dimensions();
  const auto gd = grid.dimensions();
  const auto td = table.dimensions();
  const auto vd = peaks.dimensions();
  const auto wd = weights.dimensions();
  const auto id = group.dimensions();
  const auto jd = picks.dimensions();
  const auto sd = sums->dimensions();
  const auto kd = peak->dimensions();
  const auto rd = grouped->dimensions();
  const auto xd = picked->dimensions();
  const auto cd = complete->dimensions();
  if (pd.size() != 3 || gd.size() != 3 || td.size() != 3 || vd.size() != 2 || wd.size() != 2 ||
      id.size() != 2 || jd.size() != 3 || sd.size() != 3 || kd.size() != 2 || rd.size() != 3 ||
      xd.size() != 4 || cd.size() != 2 || start.element_count() != 1)
    return ffi::Error::InvalidArgument("lj_picked_sums: ranks do not match");
  const int64_t M = pd[1], L = pd[2], C = gd[1], E = C * kFormats, K = td[1], J = jd[1],
                G = rd[1], k = sd[2];
  if (gd[0] != M || gd[2] != 1 || td[0] != M || td[2] != E || vd[0] != M || vd[1] != E ||
      wd[0] != M || wd[1] != E || id[0] != M || id[1] != E || jd[0] != M || jd[2] != E ||
      sd[0] != M || sd[1] != K || kd[0] != M || kd[1] != k || rd[0] != M || rd[2] != k ||
      xd[0] != M || xd[1] != J || xd[2] != C || xd[3] != k || cd[0] != M || cd[1] != k)
    return ffi::Error::InvalidArgument("lj_picked_sums: shapes do not match");
  const int64_t first = std::clamp<int64_t>(start.typed_data()[0], 0, pd[0]);
  const PickTable& t = PickTableFor(grid.typed_data(), table.typed_data(), peaks.typed_data(),
                                    weights.typed_data(), group.typed_data(), picks.typed_data(),
                                    M, C, K, J, G, L);
  const PickArgs a{prec.typed_data() + size_t(first) * M * L, M, L, C, K, J, G,
                   std::clamp<int64_t>(pd[0] - first, 0, k), k, sums->typed_data(),
                   peak->typed_data(), grouped->typed_data(), picked->typed_data(),
                   complete->typed_data()};
  const int64_t tiles = (k + kPickPlans - 1) / kPickPlans;
  ParallelChunks(tiles > 1 ? &pool : nullptr, tiles, [&](int64_t i) {
    if (isa >= kAvx512) PickTile(a, t, i * kPickPlans, std::min(k, (i + 1) * kPickPlans));
    else if ((i + 1) * kPickPlans <= k) PickTile2<true>(a, t, i * kPickPlans, (i + 1) * kPickPlans);
    else PickTile2<false>(a, t, i * kPickPlans, k);
  });
  return ffi::Error::Success();
#else
  return ffi::Error::InvalidArgument("lj_picked_sums: needs AVX2");
#endif
}

// ---------------------------------------------------------------------------------------
// Fence: the output aliases the input (native.py asks XLA for it), so nothing moves unless
// XLA had to give the output its own buffer.
ffi::Error Fence(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  if (y->untyped_data() != x.untyped_data())
    std::memcpy(y->untyped_data(), x.untyped_data(), x.size_bytes());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LjFormatCounts, FormatCounts,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::PRED>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LjRowsStability, RowsStability,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("fallback"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LjWeightedSums, WeightedSums,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LjPickedSums, PickedSums,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LjFence, Fence,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

// ---------------------------------------------------------------------------------------
// compact(base, precision, pair, entries, class_pairs, capacities) -> capacity: one host
// plan's (class, format) entries, what rowclasses.compact_entries computes with NumPy (one
// call instead of ~10 NumPy calls; a single plan's call is latency-bound). base intp[M, L]
// (a row's pair number in format 0), precision [M, L] (any integer type, C order), pair
// intp[M, L] (written: base + precision), entries int32[>= M * max(capacities)] (written:
// the first M * capacity as [M, capacity], each tenant's used class pairs in ascending order,
// (pair % class_pairs) << 16 | rows, then zeros). capacities: ascending ints. Returns the
// smallest capacity that holds every tenant's pairs; 0 when none does; -1 when a format id
// lies outside [0, kFormats) (nothing useful written: the caller validates, which raises);
// None when an argument is not of the kinds above, class_pairs exceeds kMaxClassPairs or
// the counts cannot be allocated (the caller falls back to NumPy). Never raises.
// Optionally (table, sums): table float32[M, class_pairs, T] (C order), sums float32[M, T]
// (written where a capacity holds the pairs: each tenant's pairs' row counts times their
// rows of the table, summed in float32; the row totals of a plan's plan-independent row
// terms, physics.kernel._pair_row_terms). None also when an output (pair, entries, sums)
// shares memory with another argument, or a pair holds 2^16 rows or more (a base that
// sends rows of several tenants to one pair: its count would not fit its entry).

// Pair numbers (base + id) and per-pair row counts of ids of type T; false when an id lies
// outside [0, kFormats).
template <typename T>
static bool PairCounts(const T* ids, const int64_t* base, int64_t n_rows, int64_t class_numbers,
                       int64_t* pair, int32_t* counts) {
  for (int64_t i = 0; i < n_rows; ++i) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    if (id < 0 || id >= kFormats) return false;  // (an unsigned id beyond int64 reads < 0)
    const int64_t n = static_cast<int64_t>(static_cast<uint64_t>(base[i]) + uint64_t(id));
    pair[i] = n;
    if (n >= 0 && n < class_numbers) ++counts[n];
  }
  return true;
}

// The integer format code of a native-order buffer format ("i", "=i", "<q"...), 0 if none.
static char IntCode(const char* format, Py_ssize_t itemsize) {
  if (!format) return 'B';
  if (format[0] == '@' || format[0] == '=' ||
      (format[0] == '<' && PY_LITTLE_ENDIAN) || (format[0] == '>' && !PY_LITTLE_ENDIAN))
    ++format;
  const char c = format[0];
  if (!c || format[1]) return 0;
  const char* codes = "bBhHiIlLqQ";
  if (!std::strchr(codes, c)) return 0;
  if ((c == 'l' || c == 'L') && itemsize != 8) return 0;
  return c;
}

static bool IsInt64(const Py_buffer& v) {
  const char c = IntCode(v.format, v.itemsize);
  return v.itemsize == 8 && (c == 'l' || c == 'q');
}

struct BufferView {  // a Py_buffer released on scope exit
  Py_buffer view{};
  bool held = false;
  bool Get(PyObject* obj, int flags) {
    held = PyObject_GetBuffer(obj, &view, flags) == 0;
    if (!held) PyErr_Clear();
    return held;
  }
  ~BufferView() {
    if (held) PyBuffer_Release(&view);
  }
};

constexpr Py_ssize_t kMaxClassPairs = 1 << 15;  // (j << 16 | rows) fits an int32 entry

// Whether two buffers' bytes overlap.
static bool Overlap(const Py_buffer& a, const Py_buffer& b) {
  const char* pa = static_cast<const char*>(a.buf);
  const char* pb = static_cast<const char*>(b.buf);
  return a.len > 0 && b.len > 0 && pa < pb + b.len && pb < pa + a.len;
}

static PyObject* Compact(PyObject*, PyObject* args) {
  PyObject *base_obj, *prec_obj, *pair_obj, *entries_obj, *caps_obj;
  PyObject *table_obj = Py_None, *sums_obj = Py_None;
  Py_ssize_t class_pairs;
  if (!PyArg_ParseTuple(args, "OOOOnO|OO", &base_obj, &prec_obj, &pair_obj, &entries_obj,
                        &class_pairs, &caps_obj, &table_obj, &sums_obj)) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  BufferView base, prec, pair, entries, table, sums;
  const int in = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT, out = in | PyBUF_WRITABLE;
  if (!base.Get(base_obj, in) || !prec.Get(prec_obj, in) || !pair.Get(pair_obj, out) ||
      !entries.Get(entries_obj, out) || !PyTuple_Check(caps_obj))
    Py_RETURN_NONE;
  const bool summed = table_obj != Py_None || sums_obj != Py_None;
  if (summed && (!table.Get(table_obj, in) || !sums.Get(sums_obj, out)))
    Py_RETURN_NONE;
  // No output may share memory with another argument (a result read back, or an input
  // overwritten before it is read, would be wrong or out of bounds).
  const Py_buffer* outputs[] = {&pair.view, &entries.view, summed ? &sums.view : nullptr};
  const Py_buffer* all[] = {&base.view, &prec.view, &pair.view, &entries.view,
                            summed ? &table.view : nullptr, summed ? &sums.view : nullptr};
  for (const Py_buffer* o : outputs)
    for (const Py_buffer* a : all)
      if (o && a && o != a && Overlap(*o, *a)) Py_RETURN_NONE;
  const char prec_code = IntCode(prec.view.format, prec.view.itemsize);
  if (base.view.ndim != 2 || prec.view.ndim != 2 || pair.view.ndim != 2 || !prec_code ||
      !IsInt64(base.view) || !IsInt64(pair.view) ||
      IntCode(entries.view.format, entries.view.itemsize) != 'i' || entries.view.itemsize != 4)
    Py_RETURN_NONE;
  const Py_ssize_t m = base.view.shape[0], l = base.view.shape[1];
  if (prec.view.shape[0] != m || prec.view.shape[1] != l || pair.view.shape[0] != m ||
      pair.view.shape[1] != l || class_pairs <= 0 || class_pairs > kMaxClassPairs ||
      l >= (1 << 16))
    Py_RETURN_NONE;
  const auto is_float32 = [](const Py_buffer& v) {
    return v.itemsize == 4 && v.format && (!std::strcmp(v.format, "f") ||
                                           !std::strcmp(v.format, "=f") ||
                                           (!std::strcmp(v.format, "<f") && PY_LITTLE_ENDIAN));
  };
  const Py_ssize_t terms = summed && table.view.ndim == 3 ? table.view.shape[2] : 0;
  if (summed && (table.view.ndim != 3 || sums.view.ndim != 2 || !is_float32(table.view) ||
                 !is_float32(sums.view) || table.view.shape[0] != m ||
                 table.view.shape[1] != class_pairs || sums.view.shape[0] != m ||
                 sums.view.shape[1] != terms))
    Py_RETURN_NONE;
  const Py_ssize_t n_caps = PyTuple_GET_SIZE(caps_obj);
  std::vector<Py_ssize_t> caps(n_caps);
  for (Py_ssize_t k = 0; k < n_caps; ++k) {
    caps[k] = PyLong_AsSsize_t(PyTuple_GET_ITEM(caps_obj, k));
    if (caps[k] < 0 || (k && caps[k] < caps[k - 1])) {
      PyErr_Clear();
      Py_RETURN_NONE;
    }
  }
  const Py_ssize_t most = n_caps ? caps[n_caps - 1] : 0;
  if (m > 0 && entries.view.len / 4 / m < most) Py_RETURN_NONE;  // (no product to overflow)
  const int64_t* b = static_cast<const int64_t*>(base.view.buf);
  int64_t* p = static_cast<int64_t*>(pair.view.buf);
  const void* f = prec.view.buf;
  std::vector<int32_t> counts;
  try {
    counts.assign(static_cast<size_t>(m) * static_cast<size_t>(class_pairs), 0);
  } catch (const std::exception&) {  // (m is an array's length, class_pairs bounded)
    Py_RETURN_NONE;
  }
  const int64_t n = static_cast<int64_t>(m) * l, numbers = static_cast<int64_t>(m) * class_pairs;
  int32_t* c = counts.data();
  bool ok;
  switch (prec_code) {
    case 'b': ok = PairCounts(static_cast<const int8_t*>(f), b, n, numbers, p, c); break;
    case 'B': ok = PairCounts(static_cast<const uint8_t*>(f), b, n, numbers, p, c); break;
    case 'h': ok = PairCounts(static_cast<const int16_t*>(f), b, n, numbers, p, c); break;
    case 'H': ok = PairCounts(static_cast<const uint16_t*>(f), b, n, numbers, p, c); break;
    case 'i': ok = PairCounts(static_cast<const int32_t*>(f), b, n, numbers, p, c); break;
    case 'I': ok = PairCounts(static_cast<const uint32_t*>(f), b, n, numbers, p, c); break;
    case 'l': case 'q': ok = PairCounts(static_cast<const int64_t*>(f), b, n, numbers, p, c); break;
    default: ok = PairCounts(static_cast<const uint64_t*>(f), b, n, numbers, p, c); break;
  }
  if (!ok) return PyLong_FromLong(-1);
  Py_ssize_t used_most = 0;
  for (Py_ssize_t t = 0; t < m; ++t) {
    Py_ssize_t used = 0;
    for (Py_ssize_t j = 0; j < class_pairs; ++j) used += counts[t * class_pairs + j] != 0;
    used_most = std::max(used_most, used);
  }
  Py_ssize_t cap = 0;  // the smallest capacity that holds them; 0 (None) when none does
  for (Py_ssize_t k = 0; k < n_caps; ++k)
    if (caps[k] >= used_most) {
      cap = caps[k];
      break;
    }
  if (!cap) return PyLong_FromLong(0);
  for (Py_ssize_t i = 0; i < m * class_pairs; ++i)  // (a count must fit its 16 bits)
    if (counts[i] >= (1 << 16)) Py_RETURN_NONE;
  int32_t* e = static_cast<int32_t*>(entries.view.buf);
  const float* tab = summed ? static_cast<const float*>(table.view.buf) : nullptr;
  float* out_sums = summed ? static_cast<float*>(sums.view.buf) : nullptr;
  for (Py_ssize_t t = 0; t < m; ++t) {
    int32_t* row = e + t * cap;
    float* acc = summed ? out_sums + t * terms : nullptr;  // float32 sums, as XLA's
    if (summed) std::fill(acc, acc + terms, 0.0f);
    Py_ssize_t k = 0;
    for (Py_ssize_t j = 0; j < class_pairs; ++j) {
      const int32_t c = counts[t * class_pairs + j];
      if (!c) continue;
      row[k++] = static_cast<int32_t>((j << 16) | c);
      if (!summed) continue;
      const float w = static_cast<float>(c);  // (read from the counts: no output is read)
      const float* terms_row = tab + (t * class_pairs + j) * terms;
      for (Py_ssize_t q = 0; q < terms; ++q) acc[q] += w * terms_row[q];
    }
    std::fill(row + k, row + cap, 0);
  }
  return PyLong_FromSsize_t(cap);
}

// ---------------------------------------------------------------------------------------
// The Python module: handlers() -> {target name: PyCapsule}, cpu() -> {feature: bool},
// compact(...) (above).

static PyObject* Handlers(PyObject*, PyObject*) {
  PyObject* out = PyDict_New();
  if (!out) return nullptr;
  const struct {
    const char* name;
    void* fn;
  } targets[] = {{"lj_format_counts", reinterpret_cast<void*>(LjFormatCounts)},
                 {"lj_rows_stability", reinterpret_cast<void*>(LjRowsStability)},
                 {"lj_weighted_sums", reinterpret_cast<void*>(LjWeightedSums)},
                 {"lj_picked_sums", reinterpret_cast<void*>(LjPickedSums)},
                 {"lj_fence", reinterpret_cast<void*>(LjFence)}};
  for (const auto& t : targets) {
    PyObject* capsule = PyCapsule_New(t.fn, nullptr, nullptr);
    if (!capsule || PyDict_SetItemString(out, t.name, capsule) < 0) {
      Py_XDECREF(capsule);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(capsule);
  }
  return out;
}

static PyObject* Cpu(PyObject*, PyObject*) {
  return Py_BuildValue("{s:O,s:O,s:O,s:s,s:s,s:i}", "avx512_vbmi",
                       HasVbmi() ? Py_True : Py_False, "avx512",
                       HasAvx512() ? Py_True : Py_False, "avx2", HasAvx2() ? Py_True : Py_False,
                       "isa", kIsaNames[Isa()], "detected", kIsaNames[DetectedIsa()], "formats",
                       kFormats);
}

// limit_isa(name) -> the previous cap's name: the best instruction set the kernels may use
// from now on, in this process ("scalar", "avx2", "avx512", "avx512_vbmi"); a name not among
// them raises ValueError.
static PyObject* LimitIsa(PyObject*, PyObject* arg) {
  Py_ssize_t size = 0;
  const char* name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8AndSize(arg, &size) : nullptr;
  if (!name) {
    PyErr_Clear();
    PyErr_SetString(PyExc_ValueError, "limit_isa: give an instruction set's name");
    return nullptr;
  }
  for (int level = kScalar; level <= kVbmi; ++level)
    if (size_t(size) == std::strlen(kIsaNames[level]) && !std::strcmp(name, kIsaNames[level]))
      return PyUnicode_FromString(kIsaNames[g_isa_cap.exchange(level)]);
  PyErr_Format(PyExc_ValueError, "limit_isa: %s is none of scalar, avx2, avx512, avx512_vbmi",
               name);
  return nullptr;
}

static PyMethodDef kMethods[] = {
    {"handlers", Handlers, METH_NOARGS, "XLA FFI handlers: {target name: PyCapsule}."},
    {"cpu", Cpu, METH_NOARGS, "The CPU features the kernels use, and their format count."},
    {"compact", Compact, METH_VARARGS, "One host plan's (class, format) entries (see above)."},
    {"limit_isa", LimitIsa, METH_O, "Caps the instruction set the kernels use (see above)."},
    {nullptr, nullptr, 0, nullptr}};

static struct PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native",
                                     "XLA FFI kernels of libratio_jax (physics/native.py).", -1,
                                     kMethods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&kModule); }
