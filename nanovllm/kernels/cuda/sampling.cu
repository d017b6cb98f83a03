// The sampler of kernels/sampling.py in CUDA C++: the same three launches, buffers, ranking and
// noise (Philox 4x32, 7 rounds, Triton's counter layout and uniform conversion), so a seeded
// row draws the same token on either path up to float rounding. Block-wide reductions, scans
// and the final sort of the top-k candidates are CUB's.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

namespace {

constexpr int kThreads = 256;
constexpr int kGroup = 32;  // tokens a group maximum covers: one warp's tokens of one load
constexpr int kRounds = 7;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kUMax = 0.99999994f;  // largest float below 1: u = 1 would make the noise +inf
constexpr float kInf = __builtin_huge_valf();

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// Triton's tl.randint4x(seed, counter) with `rounds` rounds, for an int32 counter.
__device__ __forceinline__ uint4 philox(uint64_t seed, uint32_t counter) {
  uint32_t c0 = counter, c1 = 0, c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#pragma unroll
  for (int r = 0; r < kRounds; ++r) {
    const uint32_t p0 = c0, p2 = c2;
    c0 = __umulhi(0xCD9E8D57u, p2) ^ c1 ^ k0;
    c2 = __umulhi(0xD2511F53u, p0) ^ c3 ^ k1;
    c1 = 0xCD9E8D57u * p2;
    c3 = 0xD2511F53u * p0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return make_uint4(c0, c1, c2, c3);
}

// Triton's uint_to_uniform_float, then Gumbel noise in base 2: -log2(-log2(u)).
__device__ __forceinline__ float gumbel2(uint32_t bits) {
  int32_t i = static_cast<int32_t>(bits);
  i = i < 0 ? ~i : i;
  const float u = fminf(static_cast<float>(i) * 4.6566127342e-10f, kUMax);
  return -__log2f(-__log2f(u));
}

__device__ __forceinline__ uint32_t component(uint4 v, int part) {
  return part == 0 ? v.x : part == 1 ? v.y : part == 2 ? v.z : v.w;
}

// The noise of token t alone, as the scan draws it: counter t - t % 4n + t % n, output (t % 4n) / n.
__device__ __forceinline__ float token_noise(uint64_t seed, int token, int noise_block) {
  const int span = 4 * noise_block;
  const uint4 bits = philox(seed, token - token % span + token % noise_block);
  return gumbel2(component(bits, (token % span) / noise_block));
}

// float -> uint32 whose unsigned order is the floats' order.
__device__ __forceinline__ uint32_t orderable(float x) {
  const uint32_t bits = __float_as_uint(x);
  return (bits >> 31) ? ~bits : bits | 0x80000000u;
}
__device__ __forceinline__ float unorder(uint32_t key) {
  return __uint_as_float((key >> 31) ? key & 0x7FFFFFFFu : ~key);
}

struct Row {  // what a row asks for, read the same way by every kernel
  float temperature, top_p, min_p;
  int top_k;  // 0: off
};

__device__ __forceinline__ Row read_row(int row, int vocab, const float* temperatures, const int64_t* top_ks,
                                        const float* top_ps, const float* min_ps) {
  Row r{temperatures[row], 1.f, 0.f, 0};
  if (top_ks) {
    const int64_t k = top_ks[row];
    r.top_k = k >= 1 && k < vocab ? static_cast<int>(k) : 0;
  }
  if (top_ps) r.top_p = top_ps[row];
  if (min_ps) r.min_p = min_ps[row];
  return r;
}

struct Best {  // a candidate for argmax: the larger value, then the lower index
  float value;
  int index;
};
struct BetterOf {
  __device__ __forceinline__ Best operator()(const Best& a, const Best& b) const {
    return (b.value > a.value || (b.value == a.value && b.index < a.index)) ? b : a;
  }
};
struct MaxOf {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct Plus {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};

struct ChunkShared {  // a scan or min-p program's reductions, and the chunk's or row's max
  using Reduce = cub::BlockReduce<float, kThreads>;
  using ReduceBest = cub::BlockReduce<Best, kThreads>;
  union {
    typename Reduce::TempStorage reduce;
    typename ReduceBest::TempStorage best;
  } temp;
  float max;
};

__device__ __forceinline__ void keep_better(Best& best, float value, int index) {
  if (value > best.value || (value == best.value && index < best.index)) best = {value, index};
}

// Chunk of 4 * noise_block tokens: part p, load e of thread t reads token base + p * n + e * 256 + t,
// whose noise is output p of the Philox call at counter base + e * 256 + t. One warp's 32 tokens of
// one load are one group.
template <typename T>
__global__ void __launch_bounds__(kThreads) scan_kernel(
    const T* __restrict__ logits, int64_t row_stride, int vocab, int noise_block, const float* temperatures,
    const int64_t* seeds, const int64_t* top_ks, const float* top_ps, const float* min_ps, float* best_out,
    int* index_out, float* max_out, float* sum_out, float* group_max, int num_groups, bool logprobs, bool groups) {
  const int row = blockIdx.x, chunk = blockIdx.y, chunks = gridDim.y, t = threadIdx.x;
  const Row r = read_row(row, vocab, temperatures, top_ks, top_ps, min_ps);
  const bool noise = r.temperature > 0 && r.top_k == 0 && r.top_p >= 1 && !(r.min_p > 0);
  const T* row_ptr = logits + row * row_stride;
  const int base = chunk * 4 * noise_block;
  const int loads = (noise_block + kThreads - 1) / kThreads;
  __shared__ ChunkShared s;

  float x[4][4];
  float local_max = -kInf;
#pragma unroll
  for (int p = 0; p < 4; ++p) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = e * kThreads + t, col = base + p * noise_block + j;
      x[p][e] = e < loads && j < noise_block && col < vocab ? to_float(row_ptr[col]) : -kInf;
      local_max = fmaxf(local_max, x[p][e]);
      if (groups && e < loads && e * kThreads < noise_block) {  // the whole warp takes this branch
        float g = x[p][e];
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) g = fmaxf(g, __shfl_xor_sync(0xffffffffu, g, offset));
        const int group = (base + p * noise_block + e * kThreads) / kGroup + t / kGroup;
        if (t % kGroup == 0 && j < noise_block && group < num_groups) group_max[row * num_groups + group] = g;
      }
    }
  }
  const float chunk_max = ChunkShared::Reduce(s.temp.reduce).Reduce(local_max, MaxOf());
  if (t == 0) {
    s.max = chunk_max;
    max_out[row * chunks + chunk] = chunk_max;
  }
  __syncthreads();
  if (logprobs) {
    const float scale = kLog2e / (r.temperature > 0 ? r.temperature : 1.f);
    const float shift = s.max > -kInf ? s.max : 0.f;
    float total = 0.f;
#pragma unroll
    for (int p = 0; p < 4; ++p)
#pragma unroll
      for (int e = 0; e < 4; ++e) total += exp2f((x[p][e] - shift) * scale);
    total = ChunkShared::Reduce(s.temp.reduce).Reduce(total, Plus());
    if (t == 0) sum_out[row * chunks + chunk] = total;
    __syncthreads();
  }
  Best best{-kInf, vocab};
  if (noise) {
    const uint64_t seed = static_cast<uint64_t>(seeds[row]);
    const float scale = kLog2e / r.temperature;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = e * kThreads + t;
      if (e >= loads || j >= noise_block) continue;
      const uint4 bits = philox(seed, base + j);
#pragma unroll
      for (int p = 0; p < 4; ++p)
        keep_better(best, x[p][e] * scale + gumbel2(component(bits, p)), base + p * noise_block + j);
    }
  } else {
#pragma unroll
    for (int p = 0; p < 4; ++p)
#pragma unroll
      for (int e = 0; e < 4; ++e) keep_better(best, x[p][e], base + p * noise_block + e * kThreads + t);
  }
  best = ChunkShared::ReduceBest(s.temp.best).Reduce(best, BetterOf());
  if (t == 0) {
    best_out[row * chunks + chunk] = best.value;
    index_out[row * chunks + chunk] = best.index;
  }
}

// Rows whose only filter is min-p draw again over their chunk now that their max is known.
template <typename T>
__global__ void __launch_bounds__(kThreads) min_p_draw_kernel(
    const T* __restrict__ logits, int64_t row_stride, int vocab, int noise_block, const float* temperatures,
    const int64_t* seeds, const int64_t* top_ks, const float* top_ps, const float* min_ps, float* best_out,
    int* index_out, const float* max_in) {
  const int row = blockIdx.x, chunk = blockIdx.y, chunks = gridDim.y, t = threadIdx.x;
  const Row r = read_row(row, vocab, temperatures, top_ks, top_ps, min_ps);
  if (!(r.temperature > 0 && r.min_p > 0 && r.top_k == 0 && r.top_p >= 1)) return;
  __shared__ ChunkShared s;
  float local_max = -kInf;
  for (int c = t; c < chunks; c += kThreads) local_max = fmaxf(local_max, max_in[row * chunks + c]);
  const float row_max = ChunkShared::Reduce(s.temp.reduce).Reduce(local_max, MaxOf());
  if (t == 0) s.max = row_max;
  __syncthreads();
  const float floor = logf(r.min_p), scale = kLog2e / r.temperature;
  const uint64_t seed = static_cast<uint64_t>(seeds[row]);
  const T* row_ptr = logits + row * row_stride;
  const int base = chunk * 4 * noise_block;
  Best best{-kInf, vocab};
  for (int j = t; j < noise_block; j += kThreads) {
    const uint4 bits = philox(seed, base + j);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int col = base + p * noise_block + j;
      const float x = col < vocab ? to_float(row_ptr[col]) : -kInf;
      // the row's max is kept where p / p_max is NaN (a +inf max) and where every logit is -inf
      if (x == s.max || (x > -kInf && (x - s.max) / r.temperature >= floor))
        keep_better(best, x * scale + gumbel2(component(bits, p)), col);
    }
  }
  __syncthreads();
  best = ChunkShared::ReduceBest(s.temp.best).Reduce(best, BetterOf());
  if (t == 0) {
    best_out[row * chunks + chunk] = best.value;
    index_out[row * chunks + chunk] = best.index;
  }
}

struct FinalizeShared {
  using Reduce = cub::BlockReduce<float, kThreads>;
  using ReduceInt = cub::BlockReduce<int, kThreads>;
  using ReduceBest = cub::BlockReduce<Best, kThreads>;
  using Scan = cub::BlockScan<int, kThreads>;
  using ScanFloat = cub::BlockScan<float, kThreads>;
  using Sort = cub::BlockRadixSort<unsigned long long, kThreads, 1>;
  union {
    typename Reduce::TempStorage reduce;
    typename ReduceInt::TempStorage reduce_int;
    typename ReduceBest::TempStorage best;
    typename Scan::TempStorage scan;
    typename ScanFloat::TempStorage scan_float;
    typename Sort::TempStorage sort;
  } temp;
  int count;
  int token;
  float value;
};

// The largest key with at least k of keys[0, n) at or above it: bisection over int32 keys.
__device__ int kth_largest(const int* keys, int n, int k, FinalizeShared& s) {
  int64_t lo = INT32_MIN, hi = INT32_MAX;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    int count = 0;
    for (int i = threadIdx.x; i < n; i += kThreads) count += keys[i] >= mid;
    count = FinalizeShared::ReduceInt(s.temp.reduce_int).Sum(count);
    if (threadIdx.x == 0) s.count = count;
    __syncthreads();
    if (s.count >= k) lo = mid; else hi = mid - 1;
    __syncthreads();
  }
  return static_cast<int>(lo);
}

// Of keys[0, n) (in increasing id order), the ones above `cut` and the first `k - above` equal to it:
// their positions go, in order, to out[]. Each thread takes a run of consecutive positions so that
// block scans give every position its rank. Returns how many were written.
__device__ int take_top(const int* keys, int n, int k, int cut, int* out, FinalizeShared& s) {
  const int per_thread = (n + kThreads - 1) / kThreads, begin = threadIdx.x * per_thread;
  const int end = min(begin + per_thread, n);
  int above = 0, tied = 0;
  for (int i = begin; i < end; ++i) {
    above += keys[i] > cut;
    tied += keys[i] == cut;
  }
  int above_before, above_total, tied_before, tied_total;
  FinalizeShared::Scan(s.temp.scan).ExclusiveSum(above, above_before, above_total);
  __syncthreads();
  FinalizeShared::Scan(s.temp.scan).ExclusiveSum(tied, tied_before, tied_total);
  __syncthreads();
  const int quota = k - above_total;
  // position of a chosen key among the chosen: chosen before it = above before + min(tied before, quota)
  for (int i = begin; i < end; ++i) {
    const bool is_tied = keys[i] == cut;
    if (keys[i] > cut || (is_tied && tied_before < quota)) out[above_before + min(tied_before, quota)] = i;
    above_before += keys[i] > cut;
    tied_before += is_tied;
  }
  __syncthreads();
  return above_total + max(0, min(tied_total, quota));
}

// One block a row: rows with top-k / top-p rank their candidates (see kernels/sampling.py); the others
// take their best chunk. Dynamic shared memory: max(groups, k_pad * 32) int keys, then k_pad ints.
template <typename T>
__global__ void __launch_bounds__(kThreads) finalize_kernel(
    const T* __restrict__ logits, int64_t row_stride, int vocab, int noise_block, const float* temperatures,
    const int64_t* seeds, const int64_t* top_ks, const float* top_ps, const float* min_ps, const float* best_in,
    const int* index_in, const float* max_in, const float* sum_in, int chunks, const float* group_max,
    int num_groups, int k_pad, int64_t* tokens, float* logprobs) {
  extern __shared__ int dynamic[];
  __shared__ FinalizeShared s;
  const int row = blockIdx.x, t = threadIdx.x;
  const Row r = read_row(row, vocab, temperatures, top_ks, top_ps, min_ps);
  const T* row_ptr = logits + row * row_stride;

  Best best{-kInf, chunks};
  for (int c = t; c < chunks; c += kThreads) keep_better(best, best_in[row * chunks + c], c);
  best = FinalizeShared::ReduceBest(s.temp.best).Reduce(best, BetterOf());
  if (t == 0) s.token = index_in[row * chunks + best.index];
  __syncthreads();

  if (k_pad > 0 && r.temperature > 0 && (r.top_k > 0 || r.top_p < 1)) {
    const int k = r.top_k > 0 ? min(r.top_k, k_pad) : k_pad;
    int* keys = dynamic;
    int* picked = dynamic + max(num_groups, k_pad * kGroup);
    for (int g = t; g < num_groups; g += kThreads)
      keys[g] = static_cast<int>(orderable(group_max[row * num_groups + g]) ^ 0x80000000u);
    __syncthreads();
    // the k groups first by (max desc, id asc) hold the top k tokens: groups are runs of ids
    const int num_picked = take_top(keys, num_groups, k, kth_largest(keys, num_groups, k, s), picked, s);
    const int n = num_picked * kGroup;
    for (int i = t; i < n; i += kThreads) {
      const int id = picked[i / kGroup] * kGroup + i % kGroup;
      keys[i] = static_cast<int>(orderable(id < vocab ? to_float(row_ptr[id]) : -kInf) ^ 0x80000000u);
    }
    __syncthreads();
    // the top k tokens, by (logit desc, id asc): positions into the candidates, in id order
    const int cut = kth_largest(keys, n, k, s);
    int* top = picked + k_pad;  // after the group ids, which candidates' ids still need
    const int num_top = take_top(keys, n, k, cut, top, s);
    unsigned long long key[1] = {0ull};  // empty slots sort last
    if (t < num_top) {
      const int i = top[t], id = picked[i / kGroup] * kGroup + i % kGroup;
      key[0] = (static_cast<unsigned long long>(static_cast<uint32_t>(keys[i]) ^ 0x80000000u) << 32) | ~static_cast<uint32_t>(id);
    }
    __syncthreads();
    FinalizeShared::Sort(s.temp.sort).SortDescending(key);  // one key a thread: thread t holds rank t
    __syncthreads();
    const bool slot = t < num_top;
    const float x = slot ? unorder(static_cast<uint32_t>(key[0] >> 32)) : -kInf;
    const int id = static_cast<int>(~static_cast<uint32_t>(key[0]));
    if (t == 0) s.value = x;  // rank 0: the row's max
    __syncthreads();
    const float z = (x - s.value) / r.temperature;  // log(p / p_max)
    bool keep = slot && t < k && x > -kInf && (!(r.min_p > 0) || z >= logf(r.min_p));
    if (r.top_p < 1) {
      const float mass = keep ? expf(z) : 0.f;
      float before, total;
      FinalizeShared::ScanFloat(s.temp.scan_float).ExclusiveSum(mass, before, total);
      __syncthreads();
      keep = keep && before < r.top_p * total;
    }
    // the first rank always survives: a top_p that float32 rounds to 0 or a +inf logit (z NaN) would keep none
    keep = keep || t == 0;
    Best pick{-kInf, kThreads};
    if (keep) pick = {x * (kLog2e / r.temperature) + token_noise(static_cast<uint64_t>(seeds[row]), id, noise_block), t};
    pick = FinalizeShared::ReduceBest(s.temp.best).Reduce(pick, BetterOf());
    if (t == 0) s.count = pick.index;
    __syncthreads();
    if (t == s.count) s.token = id;
    __syncthreads();
  }
  if (t == 0) tokens[row] = s.token;
  if (logprobs) {
    const float scale = 1.f / (r.temperature > 0 ? r.temperature : 1.f);
    float local_max = -kInf;
    for (int c = t; c < chunks; c += kThreads) local_max = fmaxf(local_max, max_in[row * chunks + c]);
    const float row_max = FinalizeShared::Reduce(s.temp.reduce).Reduce(local_max, MaxOf());
    if (t == 0) s.value = row_max;
    __syncthreads();
    float total = 0.f;
    for (int c = t; c < chunks; c += kThreads) {
      const float m = max_in[row * chunks + c];
      total += m > -kInf ? sum_in[row * chunks + c] * exp2f((m - s.value) * scale * kLog2e) : 0.f;
    }
    total = FinalizeShared::Reduce(s.temp.reduce).Reduce(total, Plus());
    if (t == 0) logprobs[row] = (to_float(row_ptr[s.token]) - s.value) * scale - logf(total);
  }
}

template <typename T>
const T* data(const torch::Tensor& x) { return reinterpret_cast<const T*>(x.data_ptr()); }

template <typename F>
void for_dtype(const torch::Tensor& logits, F launch) {
  switch (logits.scalar_type()) {
    case torch::kFloat: launch(float{}); break;
    case torch::kBFloat16: launch(__nv_bfloat16{}); break;
    case torch::kHalf: launch(__half{}); break;
    default: TORCH_CHECK(false, "logits: float32, bfloat16 or float16");
  }
}

template <typename T>
T* optional_data(const std::optional<torch::Tensor>& x) { return x ? x->data_ptr<T>() : nullptr; }

}  // namespace

void scan(torch::Tensor logits, int64_t noise_block, torch::Tensor temperatures, torch::Tensor seeds,
          std::optional<torch::Tensor> top_ks, std::optional<torch::Tensor> top_ps,
          std::optional<torch::Tensor> min_ps, torch::Tensor best, torch::Tensor index, torch::Tensor maxima,
          torch::Tensor sums, torch::Tensor group_max, int64_t num_groups, bool logprobs, bool groups) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const dim3 grid(logits.size(0), best.size(1));
  for_dtype(logits, [&](auto zero) {
    using T = decltype(zero);
    scan_kernel<T><<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        data<T>(logits), logits.stride(0), logits.size(1), noise_block, temperatures.data_ptr<float>(),
        seeds.data_ptr<int64_t>(), optional_data<int64_t>(top_ks), optional_data<float>(top_ps),
        optional_data<float>(min_ps), best.data_ptr<float>(), index.data_ptr<int>(), maxima.data_ptr<float>(),
        sums.data_ptr<float>(), group_max.data_ptr<float>(), num_groups, logprobs, groups);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void min_p_draw(torch::Tensor logits, int64_t noise_block, torch::Tensor temperatures, torch::Tensor seeds,
                std::optional<torch::Tensor> top_ks, std::optional<torch::Tensor> top_ps, torch::Tensor min_ps,
                torch::Tensor best, torch::Tensor index, torch::Tensor maxima) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const dim3 grid(logits.size(0), best.size(1));
  for_dtype(logits, [&](auto zero) {
    using T = decltype(zero);
    min_p_draw_kernel<T><<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        data<T>(logits), logits.stride(0), logits.size(1), noise_block, temperatures.data_ptr<float>(),
        seeds.data_ptr<int64_t>(), optional_data<int64_t>(top_ks), optional_data<float>(top_ps),
        min_ps.data_ptr<float>(), best.data_ptr<float>(), index.data_ptr<int>(), maxima.data_ptr<float>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void finalize(torch::Tensor logits, int64_t noise_block, torch::Tensor temperatures, torch::Tensor seeds,
              std::optional<torch::Tensor> top_ks, std::optional<torch::Tensor> top_ps,
              std::optional<torch::Tensor> min_ps, torch::Tensor best, torch::Tensor index, torch::Tensor maxima,
              torch::Tensor sums, torch::Tensor group_max, int64_t num_groups, int64_t k_pad, torch::Tensor tokens,
              std::optional<torch::Tensor> logprobs) {
  TORCH_CHECK(k_pad <= kThreads, "k_pad: at most ", kThreads);
  const c10::cuda::CUDAGuard guard(logits.device());
  const size_t shared = k_pad > 0 ? (std::max<int64_t>(num_groups, k_pad * kGroup) + 2 * k_pad) * sizeof(int) : 0;
  for_dtype(logits, [&](auto zero) {
    using T = decltype(zero);
    auto kernel = finalize_kernel<T>;
    if (shared > 48 * 1024)
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
    kernel<<<logits.size(0), kThreads, shared, at::cuda::getCurrentCUDAStream()>>>(
        data<T>(logits), logits.stride(0), logits.size(1), noise_block, temperatures.data_ptr<float>(),
        seeds.data_ptr<int64_t>(), optional_data<int64_t>(top_ks), optional_data<float>(top_ps),
        optional_data<float>(min_ps), best.data_ptr<float>(), index.data_ptr<int>(), maxima.data_ptr<float>(),
        sums.data_ptr<float>(), best.size(1), group_max.data_ptr<float>(), num_groups, k_pad,
        tokens.data_ptr<int64_t>(), optional_data<float>(logprobs));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
