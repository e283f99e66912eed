// The class path's per-row work on an NVIDIA GPU (compute capability 8.0 or later) as one
// CUDA kernel behind an XLA FFI handler: `lj_class_sums_cuda`, what
// `physics.gpu_kernels.class_sums` (a Pallas kernel) computes, with the counting done in
// 8-bit integer tensor-core products (issue 17; docs/performance.md, thirty-fifth round).
//
// Why: the Pallas kernel built a bf16 one-hot per (row, format), three instructions each,
// ~4,200 warp-instructions per plan (benchmarks/kernel_sass.py): 15-17 ms for 1,048,576
// reference plans on an H200, where reading them takes ~0.8 ms. Here each 32-bit word of four
// row ids becomes a 16-bit PRMT selector once (out-of-domain ids made >= 12 first), and one
// `prmt.b32` per pair of formats turns it into four int8 lanes holding 1 (the pair's first
// format), 64 (its second) or 0: six instructions per word for twelve formats. Their
// `mma.sync m16n8k32` products with the rows' class membership (0/1) count, per plan and
// class, `n_first + 64 n_second` (exact while a class holds at most 63 rows). The counts
// stay in registers: the per-entry roofline on the CUDA cores, the weighted sums as bf16
// tensor-core products (each table split into three bf16 parts, the counts exact in bf16),
// a column of ones in the table giving each plan's rows counted.
//
// Measured on an H200 (1,048,576 reference plans): 3.25 ms of kernel time in a call's trace
// (4.0 ms timed alone with its operands' preparation), the Pallas kernel 14.8 ms; ~940 warp-instructions per plan, 35% of the issue slots busy, 25%
// occupancy (105 registers). Nsight Compute puts ~57% of the stall samples on the epilogue's
// loads of the tables and entries (each warp reads its tenant's ~34 KB per 16 plans; L1 hit
// rate 70%) and 67% of the shared-memory wavefronts in excess (bank conflicts of the rows'
// reads): the next steps (docs/performance.md, thirty-fifth round).
//
// The operands come prepared by `physics/cuda_kernels.py` (the layouts below); the ids are
// the plans' own bytes, `uint8[B, M, L]`, read where they lie.
//
// Layouts (M tenants, KS = ceil(L / 32) steps of 32 rows, F = 12 formats, 16 classes,
// KT tiles of 8 summed terms):
//   member uint32[M, KS, 32 lanes, 4]: B fragments of the membership, rows permuted so that
//          lane (g, t) of a step reads its plan's rows 8t..8t+7 (below);
//   plan   float32[M, B, 16]: per plan reads/hbm, expert reads/hbm, work/hbm, 0, then
//          work x seconds-per-FLOP of each format;
//   entry  float32[M, F, 16, 8]: per (format, class) flops, weight bytes of non-expert and
//          of expert rows, io bytes (all 0 where the entry is not valid), the peak term;
//   table  uint32[M, F, KT, 3, 32 lanes, 2]: B fragments of the summed terms, per bf16 part;
//   out    roof float32[M, B], sums float32[M, 8 KT, B], peak float32[M, B].
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kPlansPerBlock = 16;  // one warp's MMA rows: 16 plans of one tenant
constexpr int kMaxTenants = 16;     // warps per block, one per tenant
constexpr int kPairs = 6;           // twelve formats, two per product
constexpr int kSlack = 64;          // bytes past the plans in shared memory (0xFF)
// A block's shared memory at most on Hopper; less elsewhere (163 KB on an A100, ~99 KB on
// compute capability 8.6 and 8.9): LjClassSumsCudaProbe reports the device's, which
// cuda_kernels.supports() respects.
constexpr int64_t kMaxSharedBytes = 227 * 1024;
// The operands' layouts: bumped with every change of them, checked by cuda_kernels.status()
// (an extension built from older sources is not used).
constexpr int kAbiVersion = 1;

__device__ __forceinline__ uint32_t Prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// The PRMT selector of four one-byte ids (a nibble each), an id >= 12 (out of the domain:
// NO_FORMAT, 255, any other) made a nibble in 12..15, which every table below maps to 0.
__device__ __forceinline__ uint32_t Selector(uint32_t w) {
  const uint32_t t = (w | 0x80808080u) - 0x0C0C0C0Cu;  // no borrow crosses a byte
  const uint32_t ge = (t | w) & 0x80808080u;           // bit 7 of a byte: id >= 12
  const uint32_t x = (w & 0x0F0F0F0Fu) | (ge >> 4) | (ge >> 5);
  const uint32_t y = x | (x >> 4);  // bytes 0 and 2 hold nibbles (0, 1) and (2, 3)
  return Prmt(y, 0u, 0x4420u);
}

// Four int8 lanes of pair j (formats 2j, 2j + 1): 1, 64 or 0 per id. A selector nibble
// n < 8 picks table byte n; n >= 8 gives the sign of byte n - 8, 0 (every byte < 0x80).
// Pairs 4 and 5 (formats 8-11) read the selector with bit 3 of each nibble flipped.
__device__ __forceinline__ void OneHots(uint32_t w, uint32_t (&out)[kPairs]) {
  const uint32_t sel = Selector(w);
  const uint32_t high = sel ^ 0x8888u;
  out[0] = Prmt(0x00004001u, 0u, sel);
  out[1] = Prmt(0x40010000u, 0u, sel);
  out[2] = Prmt(0u, 0x00004001u, sel);
  out[3] = Prmt(0u, 0x40010000u, sel);
  out[4] = Prmt(0x00004001u, 0u, high);
  out[5] = Prmt(0x40010000u, 0u, high);
}

__device__ __forceinline__ void MmaS8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                      uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void MmaBf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<uint32_t*>(&v);
}

// Rows r..r+7 of a plan's tenant as two words, from shared memory at any byte offset.
__device__ __forceinline__ void EightRows(const uint32_t* words, uint32_t byte, uint32_t& lo,
                                          uint32_t& hi) {
  const uint32_t i = byte >> 2, shift = (byte & 3u) * 8u;
  const uint32_t w0 = words[i], w1 = words[i + 1], w2 = words[i + 2];
  lo = __funnelshift_r(w0, w1, shift);
  hi = __funnelshift_r(w1, w2, shift);
}

// Asynchronous copies from global to shared memory (cp.async, sm_80+): every copy of a
// thread in flight at once, waited for once (against a load-then-store loop: 3.98 against
// 4.02 ms, within noise, on an H200).
__device__ __forceinline__ void CopyAsync16(void* dst, const void* src) {
  const uint32_t s = uint32_t(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(src));
}
__device__ __forceinline__ void WaitCopies() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// One block: 16 plans, every tenant (warp m: tenant m). Lane (g, t) = (lane / 4, lane % 4)
// holds plans g and g + 8 of the MMA fragments. (Blocks of 64 plans of one tenant, each warp
// staging its plans' rows, so that an SM's blocks read one tenant's tables: 4.9 ms against
// 4.0 ms for 1,048,576 plans on an H200, not kept; docs/performance.md.)
template <int KT>
__global__ void __launch_bounds__(32 * kMaxTenants)
ClassSumsKernel(const uint8_t* __restrict__ ids, const uint4* __restrict__ member,
                const float* __restrict__ plan, const float4* __restrict__ entry,
                const uint2* __restrict__ table, float* __restrict__ roof,
                float* __restrict__ sums, float* __restrict__ peak, int64_t num_plans,
                int tenants, int rows, int steps) {
  extern __shared__ uint4 staged[];
  const int lane = threadIdx.x & 31, m = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t first = int64_t(blockIdx.x) * kPlansPerBlock;
  const int64_t plan_bytes = int64_t(tenants) * rows;

  // The block's plans, all tenants: contiguous bytes, 16-byte aligned (16 plans a block).
  {
    const int64_t in_block =
        (num_plans - first < kPlansPerBlock ? num_plans - first : kPlansPerBlock) * plan_bytes;
    const int64_t capacity = kPlansPerBlock * plan_bytes + kSlack;
    const uint8_t* src = ids + first * plan_bytes;
    uint8_t* dst = reinterpret_cast<uint8_t*>(staged);
    const int64_t vectors = in_block / 16;
    for (int64_t i = threadIdx.x; i < vectors; i += blockDim.x)
      CopyAsync16(staged + i, src + 16 * i);
    for (int64_t i = vectors * 16 + threadIdx.x; i < capacity; i += blockDim.x)
      dst[i] = i < in_block ? src[i] : uint8_t(0xFF);
    WaitCopies();
    __syncthreads();
  }
  const uint32_t* words = reinterpret_cast<const uint32_t*>(staged);
  const uint32_t base_g = uint32_t(g * plan_bytes + m * rows + 8 * t);
  const uint32_t base_h = base_g + uint32_t(8 * plan_bytes);
  const uint4* member_m = member + int64_t(m) * steps * 32 + lane;

  int acc[kPairs][2][4] = {};
  for (int s = 0; s < steps; ++s) {
    uint32_t glo, ghi, hlo, hhi;
    EightRows(words, base_g + 32u * s, glo, ghi);
    EightRows(words, base_h + 32u * s, hlo, hhi);
    const uint4 b = __ldg(member_m + s * 32);
    uint32_t a0[kPairs], a1[kPairs], a2[kPairs], a3[kPairs];
    OneHots(glo, a0);
    OneHots(hlo, a1);
    OneHots(ghi, a2);
    OneHots(hhi, a3);
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      MmaS8(acc[j][0], a0[j], a1[j], a2[j], a3[j], b.x, b.y);
      MmaS8(acc[j][1], a0[j], a1[j], a2[j], a3[j], b.z, b.w);
    }
  }

  // Per entry: element i of tile n is plan g + 8 (i / 2), class 8 n + 2 t + i % 2.
  const int64_t pg = first + g, ph = first + g + 8;
  const float* plan_g = plan + (int64_t(m) * num_plans + (pg < num_plans ? pg : 0)) * 16;
  const float* plan_h = plan + (int64_t(m) * num_plans + (ph < num_plans ? ph : 0)) * 16;
  const float rho[2] = {__ldg(plan_g), __ldg(plan_h)};
  const float rho_x[2] = {__ldg(plan_g + 1), __ldg(plan_h + 1)};
  const float beta[2] = {__ldg(plan_g + 2), __ldg(plan_h + 2)};
  float seconds[2] = {0.f, 0.f}, largest[2] = {0.f, 0.f};
  float out[KT][4] = {};
  const float4* entry_m = entry + int64_t(m) * 12 * 16 * 2;
  const uint2* table_m = table + int64_t(m) * 12 * KT * 3 * 32 + lane;
#pragma unroll
  for (int f = 0; f < 12; ++f) {
    const int j = f >> 1, shift = (f & 1) * 6;
    const float alpha[2] = {__ldg(plan_g + 4 + f), __ldg(plan_h + 4 + f)};
    float n[2][4];
#pragma unroll
    for (int tile = 0; tile < 2; ++tile) {
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) {
        const int c = 8 * tile + 2 * t + pair;
        const float4 e0 = __ldg(entry_m + (f * 16 + c) * 2);      // flops, w, w_expert, io
        const float top = __ldg(reinterpret_cast<const float*>(entry_m + (f * 16 + c) * 2 + 1));
#pragma unroll
        for (int p = 0; p < 2; ++p) {
          const float count = float((acc[j][tile][2 * p + pair] >> shift) & 63);
          n[tile][2 * p + pair] = count;
          const float s = fmaxf(alpha[p] * e0.x,
                                fmaf(rho[p], e0.y, fmaf(rho_x[p], e0.z, beta[p] * e0.w)));
          seconds[p] = fmaf(count, s, seconds[p]);
          largest[p] = fmaxf(largest[p], count > 0.f ? top : 0.f);
        }
      }
    }
    const uint32_t a[4] = {PackBf16(n[0][0], n[0][1]), PackBf16(n[0][2], n[0][3]),
                           PackBf16(n[1][0], n[1][1]), PackBf16(n[1][2], n[1][3])};
#pragma unroll
    for (int k = 0; k < KT; ++k) {
      const uint2* frag = table_m + (f * KT + k) * 3 * 32;
#pragma unroll
      for (int part = 0; part < 3; ++part) {
        const uint2 b = __ldg(frag + part * 32);
        MmaBf16(out[k], a, b.x, b.y);
      }
    }
  }
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    seconds[p] += __shfl_xor_sync(0xFFFFFFFFu, seconds[p], 1);
    seconds[p] += __shfl_xor_sync(0xFFFFFFFFu, seconds[p], 2);
    largest[p] = fmaxf(largest[p], __shfl_xor_sync(0xFFFFFFFFu, largest[p], 1));
    largest[p] = fmaxf(largest[p], __shfl_xor_sync(0xFFFFFFFFu, largest[p], 2));
  }
  const int64_t row = int64_t(m) * num_plans;
  if (t == 0) {
    if (pg < num_plans) roof[row + pg] = seconds[0], peak[row + pg] = largest[0];
    if (ph < num_plans) roof[row + ph] = seconds[1], peak[row + ph] = largest[1];
  }
  float* sums_m = sums + int64_t(m) * 8 * KT * num_plans;
#pragma unroll
  for (int k = 0; k < KT; ++k) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t p = i < 2 ? pg : ph;
      if (p < num_plans) sums_m[int64_t(8 * k + 2 * t + (i & 1)) * num_plans + p] = out[k][i];
    }
  }
}

template <int KT>
cudaError_t Launch(cudaStream_t stream, const uint8_t* ids, const void* member,
                   const float* plan, const void* entry, const void* table, float* roof,
                   float* sums, float* peak, int64_t num_plans, int tenants, int rows,
                   int steps) {
  const size_t shared = (size_t(kPlansPerBlock) * tenants * rows + kSlack + 15) / 16 * 16;
  if (shared > 48 * 1024) {  // more than the default: asked for (at most the device's)
    cudaError_t err = cudaFuncSetAttribute(
        ClassSumsKernel<KT>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared));
    if (err != cudaSuccess) return err;
  }
  const int64_t blocks = (num_plans + kPlansPerBlock - 1) / kPlansPerBlock;
  ClassSumsKernel<KT><<<dim3(unsigned(blocks)), dim3(32 * tenants), shared, stream>>>(
      ids, static_cast<const uint4*>(member), plan, static_cast<const float4*>(entry),
      static_cast<const uint2*>(table), roof, sums, peak, num_plans, tenants, rows, steps);
  return cudaGetLastError();
}

ffi::Error ClassSums(cudaStream_t stream, ffi::Buffer<ffi::U8> ids,
                     ffi::Buffer<ffi::U32> member, ffi::Buffer<ffi::F32> plan,
                     ffi::Buffer<ffi::F32> entry, ffi::Buffer<ffi::U32> table,
                     ffi::ResultBuffer<ffi::F32> roof, ffi::ResultBuffer<ffi::F32> sums,
                     ffi::ResultBuffer<ffi::F32> peak) {
  const auto id_dims = ids.dimensions(), table_dims = table.dimensions();
  if (id_dims.size() != 3 || table_dims.size() != 6)
    return ffi::Error::InvalidArgument("lj_class_sums_cuda: ids [B, M, L], table 6-D");
  const int64_t num_plans = id_dims[0], tenants = id_dims[1], rows = id_dims[2];
  const int64_t steps = (rows + 31) / 32, tiles = table_dims[2];
  if (tenants < 1 || tenants > kMaxTenants || tiles < 1 || tiles > 4 ||
      kPlansPerBlock * tenants * rows + kSlack > kMaxSharedBytes ||
      member.element_count() != tenants * steps * 32 * 4)
    return ffi::Error::InvalidArgument("lj_class_sums_cuda: shapes out of the kernel's range");
  if (reinterpret_cast<uintptr_t>(ids.untyped_data()) % 16 != 0)  // (16-byte copies)
    return ffi::Error::InvalidArgument("lj_class_sums_cuda: ids not 16-byte aligned");
  if (num_plans == 0) return ffi::Error::Success();
  cudaError_t err = cudaSuccess;
  auto args = [&](auto launch) {
    return launch(stream, ids.typed_data(), member.untyped_data(), plan.typed_data(),
                  entry.untyped_data(), table.untyped_data(), roof->typed_data(),
                  sums->typed_data(), peak->typed_data(), num_plans, int(tenants), int(rows),
                  int(steps));
  };
  switch (tiles) {
    case 1: err = args(Launch<1>); break;
    case 2: err = args(Launch<2>); break;
    case 3: err = args(Launch<3>); break;
    default: err = args(Launch<4>); break;
  }
  if (err != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LjClassSumsCuda, ClassSums,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The layouts' version this library was built with (kAbiVersion).
extern "C" int LjClassSumsCudaAbi() { return kAbiVersion; }

// 0 when this process's current CUDA device can run the kernel (its module loads for the
// device: a driver recent enough for this build, machine code or PTX for the device), with
// the most dynamic shared memory a block may ask for there in *max_shared_bytes; else a
// CUDA error code.
extern "C" int LjClassSumsCudaProbe(int64_t* max_shared_bytes) {
  int device = 0, optin = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  cudaFuncAttributes attributes;
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attributes, ClassSumsKernel<1>);
  if (err != cudaSuccess) return int(err);
  *max_shared_bytes = int64_t(optin) - int64_t(attributes.sharedSizeBytes);
  return 0;
}
