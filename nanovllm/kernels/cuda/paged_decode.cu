// Paged attention of decode steps (one query row a sequence, heads of 64) on the tensor cores,
// for the unsplit grids of kernels/attention.py. A CTA takes a (sequence, kv head); its warps
// take the sequence's 16-key chunks in turn, each warp with its own online softmax, and are
// joined once at the end through shared memory, so no step of the key loop waits on another
// warp. Each warp streams its chunks by cp.async through a ring of kStages shared-memory slots
// of its own (a slot is refilled as soon as its chunk is read) and the block ids of its next 32
// chunks sit one a lane, so no load in the loop waits on another load. The first kStages chunks
// are requested before the PDL wait, but for the step's own key.
//
// The m16n8k16 MMA fragments are read from the slots with 16-byte loads. That works because
// the products sum over head_dim (QK) and over keys (PV), so either index may be permuted as
// long as both operands agree:
// - QK: thread (g, t) (g = lane / 4, t = lane % 4) holds B = K^T for key g of an 8-key n-tile;
//   it reads the contiguous quarter t of that key's row, and its k-step ks uses words 2ks and
//   2ks + 1 of it. Q's A fragments take the same words of the query rows.
// - PV: B = V[key][d] pairs two keys at one d in a register. Thread (g, t) reads the keys 2t,
//   2t + 1, 2t + 8, 2t + 9 of the chunk, each at the eighth g of the row, and pairs the halves
//   of equal d with a byte permute; n-tile j holds d = 8g + j, which is where the output
//   columns are written back.
// A slot stores 16-byte piece c of chunk row r at piece c ^ (r % 8), so that the eight lanes
// of each phase of those loads read eight different bank groups.
//
// A float8 (e4m3) cache moves through the same slots in pieces of 8 bytes (8 values), upcast
// to T as they leave shared memory (exact: every e4m3 value is a bf16 and an fp16 value); the
// key scale is in qk_scale and the value scale multiplies the output.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace {

constexpr int kHeadDim = 64;
constexpr int kChunk = 16;                    // keys a warp scores at a time: the MMA's k of PV
constexpr int kRows = 16;                     // query heads of a group, padded to the MMA's m
constexpr int kPieces = kHeadDim / 8;         // pieces of 8 values in a key's row (8)
// 4 warps of 3 slots: 48 KB and 128 registers a thread let 4 CTAs share an SM, so 256 x 2
// (sequence, kv head) pairs run as one wave on 132 SMs. 2 or 4 slots, 2 warps of 3 or 5
// slots and 8 warps of 2 measured slower (docs/rejected.md).
constexpr int kWarps = 4;

// The slots of a cache of element type C (T, or __nv_fp8_e4m3).
template <typename C>
struct Slots {
  static constexpr int kPieceBytes = 8 * sizeof(C);
  static constexpr int kBytes = 2 * kChunk * kHeadDim * sizeof(C);  // a chunk's K and V rows
  // float8 chunks are half the bytes: twice the slots keep as many bytes in flight, in the
  // same shared memory
  static constexpr int kStages = sizeof(C) == 1 ? 6 : 3;
};

template <typename T>
struct Mma;

template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  static __device__ __forceinline__ uint32_t from_fp8x2(uint16_t pair) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    return pack(f.x, f.y);
  }
};

template <>
struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ uint32_t from_fp8x2(uint16_t pair) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
};

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A piece (16 or 8 bytes) from global to shared memory, zeros where !valid (src is then not read).
template <int kBytes>
__device__ __forceinline__ void copy_async(uint32_t dst, const void* src, bool valid) {
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
  } else {  // .cg copies 16 bytes only
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(valid ? 8 : 0));
  }
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void wait_pending() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Byte offset in a slot's K or V half of piece `piece` of chunk row `row` (the layout
// described at the top). Float8 rows are 64 bytes, two to a 128-byte bank line: piece p of row
// r is 8-byte word (r % 2) * 8 + p of line r / 2, XORed with 4 * (line % 4) + line % 2, which
// spreads both the QK and the PV loads of a half-warp over all 32 banks.
template <typename C>
__device__ __forceinline__ int piece_offset(int row, int piece) {
  if constexpr (sizeof(C) == 2) {
    return row * kPieces * 16 + (piece ^ (row % 8)) * 16;
  } else {
    const int line = row / 2;
    return line * 128 + (((row % 2) * kPieces + piece) ^ (4 * (line % 4) + line % 2)) * 8;
  }
}

// Piece `piece` of chunk row `row` as 8 values of T.
template <typename T, typename C>
__device__ __forceinline__ uint4 load_piece(const char* slot, int row, int piece) {
  if constexpr (sizeof(C) == 2) {
    return *reinterpret_cast<const uint4*>(slot + piece_offset<C>(row, piece));
  } else {
    const uint2 fp8 = *reinterpret_cast<const uint2*>(slot + piece_offset<C>(row, piece));
    return make_uint4(Mma<T>::from_fp8x2(fp8.x & 0xffff), Mma<T>::from_fp8x2(fp8.x >> 16),
                      Mma<T>::from_fp8x2(fp8.y & 0xffff), Mma<T>::from_fp8x2(fp8.y >> 16));
  }
}

template <typename C>
__device__ __forceinline__ void copy_piece(char* dst, const C* src) {
  if constexpr (sizeof(C) == 2) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
  } else {
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(src);
  }
}

template <typename T, typename C>
__global__ void __launch_bounds__(kWarps * 32, 4)
paged_decode_kernel(const T* __restrict__ q, const C* __restrict__ k_cache, const C* __restrict__ v_cache,
                    T* __restrict__ out, const int* __restrict__ cu_seqlens_q, const int* __restrict__ seq_lens,
                    const int* __restrict__ block_tables, float qk_scale, float v_scale, int num_kv_heads, int group,
                    int block_size, int table_width, int64_t stride_qt, int64_t stride_qh, int64_t stride_ot,
                    int64_t stride_oh, int64_t stride_kb, int64_t stride_kt, int64_t stride_kh, int64_t stride_vb,
                    int64_t stride_vt, int64_t stride_vh, int64_t stride_btr) {
  constexpr int KSTEPS = kHeadDim / 16;  // k-steps of QK
  constexpr int NTILES = kHeadDim / 8;   // n-tiles of PV
  using M = Mma<T>;
  constexpr int kStages = Slots<C>::kStages, kSlotBytes = Slots<C>::kBytes;
  extern __shared__ __align__(16) char shared[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;
  const int seq = blockIdx.x / num_kv_heads, kv_head = blockIdx.x % num_kv_heads;
  // Step metadata is written before the step's kernels run, never by a kernel of the package,
  // so it is read before the wait for the kernel before, as are the keys earlier steps cached.
  const int token = cu_seqlens_q[seq];
  const int q_len = cu_seqlens_q[seq + 1] - token;  // 0 or 1
  const int seq_len = seq_lens[seq];
  const int head0 = kv_head * group;
  const int* table = block_tables + seq * stride_btr;
  // Block id of the warp's chunk `base + lane`, read within the table's width, not the
  // sequence's, so that the load need not wait for seq_len.
  auto block_ids = [&](int base) {
    const int column = (warp + kWarps * (base + lane)) * kChunk / block_size;
    return column < table_width ? table[column] : 0;
  };
  int ids = block_ids(0);

  const int chunks = q_len > 0 ? (seq_len + kChunk - 1) / kChunk : 0;
  const int my_chunks = chunks > warp ? (chunks - warp + kWarps - 1) / kWarps : 0;
  char* ring = shared + warp * kStages * kSlotBytes;
  const C* k_head = k_cache + kv_head * stride_kh + (lane % kPieces) * 8;
  const C* v_head = v_cache + kv_head * stride_vh + (lane % kPieces) * 8;
  const int written = seq_len - q_len;  // keys below this come from earlier steps
  // Chunk i of the warp into its slot, a commit group even when there is none, so that the
  // wait in the loop always counts kStages - 1 groups younger than the chunk it waits for. Rows of
  // keys from `limit` up to seq_len are left to the caller; rows past seq_len read zeros:
  // their V, even times p = 0, could be NaN.
  auto issue = [&](int i, int limit) {
    if (i < my_chunks) {
      if (i % 32 == 0 && i > 0) ids = block_ids(i);
      const int64_t block = __shfl_sync(0xffffffffu, ids, i % 32);
      const int first = (warp + kWarps * i) * kChunk;
      const int row0 = first % block_size;  // a chunk lies in one block: block_size is a multiple of kChunk
      const C* k_rows = k_head + block * stride_kb + row0 * stride_kt;
      const C* v_rows = v_head + block * stride_vb + row0 * stride_vt;
      const uint32_t k_slot = shared_address(ring + (i % kStages) * kSlotBytes);
      const uint32_t v_slot = k_slot + kSlotBytes / 2;
#pragma unroll
      for (int step = 0; step < kChunk * kPieces / 32; ++step) {
        const int row = lane / kPieces + step * (32 / kPieces);
        const int offset = piece_offset<C>(row, lane % kPieces);
        const int key = first + row;
        if (key < limit || key >= seq_len) {
          copy_async<Slots<C>::kPieceBytes>(k_slot + offset, k_rows + row * stride_kt, key < limit);
          copy_async<Slots<C>::kPieceBytes>(v_slot + offset, v_rows + row * stride_vt, key < limit);
        }
      }
    }
    commit();
  };
#pragma unroll
  for (int i = 0; i < kStages; ++i) issue(i, written);

#if __CUDA_ARCH__ >= 900
  // Programmatic dependent launch, as every kernel of the package: wait for the kernel before
  // (it wrote q and this step's keys), then let the one after be scheduled.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  if (q_len == 0) return;  // nothing in flight: no chunk was issued
  // This step's key, if a chunk issued above holds it: its rows from global memory, a piece
  // a lane, into the gap the copies left.
  const int new_chunk = written / kChunk;
  if (written >= 0 && written / block_size < table_width && new_chunk % kWarps == warp &&
      new_chunk / kWarps < kStages && lane < 2 * kPieces) {
    const int row = written % kChunk, piece = lane % kPieces;
    const int64_t block = table[written / block_size];
    const int64_t slot = written % block_size;
    const C* src = lane < kPieces ? k_head + block * stride_kb + slot * stride_kt
                                  : v_head + block * stride_vb + slot * stride_vt;
    char* dst = ring + (new_chunk / kWarps % kStages) * kSlotBytes + (lane < kPieces ? 0 : kSlotBytes / 2);
    copy_piece(dst + piece_offset<C>(row, piece), src);
  }

  uint32_t qa[KSTEPS][4];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int head = g + 8 * r;
    uint4 row[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
    if (head < group) {
      const uint4* p = reinterpret_cast<const uint4*>(q + token * stride_qt + (head0 + head) * stride_qh) + 2 * t;
      row[0] = p[0];
      row[1] = p[1];
    }
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      qa[ks][r] = word(row[ks / 2], (2 * ks) % 4);
      qa[ks][r + 2] = word(row[ks / 2], (2 * ks) % 4 + 1);
    }
  }

  float o[NTILES][4];
#pragma unroll
  for (int n = 0; n < NTILES; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY};  // rows g and g + 8, in log2 units
  float l[2] = {0.0f, 0.0f};            // this thread's share of the rows' sums

  for (int i = 0; i < my_chunks; ++i) {
    wait_pending<kStages - 1>();
    __syncwarp();  // the other lanes' copies of chunk i are visible
    const char* k_slot = ring + (i % kStages) * kSlotBytes;
    const char* v_slot = k_slot + kSlotBytes / 2;
    float s[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const uint4 k0 = load_piece<T, C>(k_slot, 8 * j + g, 2 * t), k1 = load_piece<T, C>(k_slot, 8 * j + g, 2 * t + 1);
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) {
        const uint4& k = ks < 2 ? k0 : k1;
        M::run(s[j], qa[ks], word(k, (2 * ks) % 4), word(k, (2 * ks) % 4 + 1));
      }
    }
    uint4 v[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) v[r] = load_piece<T, C>(v_slot, 8 * (r / 2) + 2 * t + r % 2, g);
    __syncwarp();  // every lane has read the slot before it is refilled
    issue(i + kStages, seq_len);
    // s[j][e]: row g + 8 * (e / 2), key 8j + 2t + e % 2 of the chunk
    const int first = (warp + kWarps * i) * kChunk;
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] = first + 8 * j + 2 * t + e % 2 < seq_len ? s[j][e] * qk_scale : -INFINITY;
        mx[e / 2] = fmaxf(mx[e / 2], s[j][e]);
      }
    }
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      alpha[r] = exp2f(m[r] - mx[r]);  // finite mx: a chunk's first key is always in range
      m[r] = mx[r];
      l[r] *= alpha[r];
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] = exp2f(s[j][e] - mx[e / 2]);
        l[e / 2] += s[j][e];
      }
    }
    const uint32_t pa[4] = {M::pack(s[0][0], s[0][1]), M::pack(s[0][2], s[0][3]), M::pack(s[1][0], s[1][1]),
                            M::pack(s[1][2], s[1][3])};
#pragma unroll
    for (int n = 0; n < NTILES; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
      // element n of each V row's piece: word n / 2, low half for even n
      const uint32_t selector = n % 2 ? 0x7632 : 0x5410;
      const uint32_t b0 = __byte_perm(word(v[0], n / 2), word(v[1], n / 2), selector);
      const uint32_t b1 = __byte_perm(word(v[2], n / 2), word(v[3], n / 2), selector);
      M::run(o[n], pa, b0, b1);
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  // The rings are free once every warp has left its loop: the warps' partial rows go there.
  __syncthreads();
  float (*partial)[kRows][kHeadDim] = reinterpret_cast<float (*)[kRows][kHeadDim]>(shared);
  float (*maxima)[kRows] = reinterpret_cast<float (*)[kRows]>(shared + kWarps * kRows * kHeadDim * 4);
  float (*sums)[kRows] = maxima + kWarps;
#pragma unroll
  for (int n = 0; n < NTILES; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) partial[warp][g + 8 * (e / 2)][(2 * t + e % 2) * NTILES + n] = o[n][e];
  }
  if (t == 0) {
    maxima[warp][g] = m[0];
    maxima[warp][g + 8] = m[1];
    sums[warp][g] = l[0];
    sums[warp][g + 8] = l[1];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < group * kHeadDim; i += kWarps * 32) {
    const int row = i / kHeadDim, d = i % kHeadDim;
    float top = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) top = fmaxf(top, maxima[w][row]);
    float acc = 0.0f, total = 0.0f;
    if (top != -INFINITY) {  // else seq_len 0: zeros
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float weight = exp2f(maxima[w][row] - top);  // a warp that saw no key weighs 0
        acc += weight * partial[w][row][d];
        total += weight * sums[w][row];
      }
      acc = acc / total * v_scale;
    }
    out[token * stride_ot + (head0 + row) * stride_oh + d] = M::from_float(acc);
  }
}

template <typename C>
constexpr int shared_bytes() {
  constexpr int ring = kWarps * Slots<C>::kStages * Slots<C>::kBytes;
  constexpr int partials = kWarps * kRows * (kHeadDim + 2) * 4;
  return ring > partials ? ring : partials;
}
// More would need cudaFuncSetAttribute, and would cost the fourth CTA an SM.
static_assert(shared_bytes<__nv_bfloat16>() <= 48 * 1024, "dynamic shared memory over the default limit");
static_assert(shared_bytes<__nv_fp8_e4m3>() <= 48 * 1024, "dynamic shared memory over the default limit");

template <typename T, typename C>
void launch(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache, torch::Tensor& out,
            const torch::Tensor& cu_seqlens_q, const torch::Tensor& seq_lens, const torch::Tensor& block_tables,
            double qk_scale, double v_scale, bool pdl) {
  const int num_kv_heads = k_cache.size(2);
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(seq_lens.size(0) * num_kv_heads);
  config.blockDim = dim3(kWarps * 32);
  config.dynamicSmemBytes = shared_bytes<C>();
  config.stream = at::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = pdl;
  config.attrs = attribute;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(
      &config, paged_decode_kernel<T, C>, reinterpret_cast<const T*>(q.data_ptr()),
      reinterpret_cast<const C*>(k_cache.data_ptr()), reinterpret_cast<const C*>(v_cache.data_ptr()),
      reinterpret_cast<T*>(out.data_ptr()), cu_seqlens_q.data_ptr<int>(), seq_lens.data_ptr<int>(),
      block_tables.data_ptr<int>(), static_cast<float>(qk_scale), static_cast<float>(v_scale), num_kv_heads,
      static_cast<int>(q.size(1) / num_kv_heads), static_cast<int>(k_cache.size(1)),
      static_cast<int>(block_tables.size(1)), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
      k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
      v_cache.stride(2), block_tables.stride(0)));
}

template <typename T>
void launch_for_cache(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                      torch::Tensor& out, const torch::Tensor& cu_seqlens_q, const torch::Tensor& seq_lens,
                      const torch::Tensor& block_tables, double qk_scale, double v_scale, bool pdl) {
  if (k_cache.scalar_type() == at::kFloat8_e4m3fn)
    launch<T, __nv_fp8_e4m3>(q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, qk_scale, v_scale, pdl);
  else
    launch<T, T>(q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, qk_scale, v_scale, pdl);
}

}  // namespace

// kernels/cuda/paged_decode.py checks the shapes, dtypes, strides and alignment this relies on.
// qk_scale holds the key scale of a float8 cache; v_scale multiplies the output.
void paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor out,
                  torch::Tensor cu_seqlens_q, torch::Tensor seq_lens, torch::Tensor block_tables, double qk_scale,
                  double v_scale, bool pdl) {
  TORCH_CHECK(q.size(2) == kHeadDim, "q: head_dim ", kHeadDim, ", got ", q.size(2));
  const c10::cuda::CUDAGuard guard(q.device());
  if (q.scalar_type() == at::kBFloat16)
    launch_for_cache<__nv_bfloat16>(q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, qk_scale,
                                    v_scale, pdl);
  else if (q.scalar_type() == at::kHalf)
    launch_for_cache<__half>(q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, qk_scale, v_scale, pdl);
  else
    TORCH_CHECK(false, "q: bfloat16 or float16");
}
