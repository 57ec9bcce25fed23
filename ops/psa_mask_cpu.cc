// CPU kernels of the PSA mask op, and the count of threads they run on.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <thread>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "psa_mask_common.h"

// CPU threads. The op runs on as many threads as the process gives Paddle's
// CPU kernels, so that ranks sharing a machine do not oversubscribe it. That
// count lives in the OpenMP runtime Paddle runs on (libiomp5 in the x86 wheels,
// libgomp elsewhere), reached through libpaddle, which this library links; it
// is per thread: OMP_NUM_THREADS (which `import paddle` sets to 1 when unset)
// for every thread, then Paddle's SetNumThreads for the thread that calls it
// (paddle.base.core.set_num_threads, and the predictor's
// set_cpu_math_library_num_threads on the thread that runs the graph).
// Weak: null where Paddle has no OpenMP.
extern "C" int omp_get_max_threads(void) __attribute__((weak));

namespace {
// Threads the last CPU call ran on, for tests (psa_mask_last_cpu_threads).
std::atomic<int> last_cpu_threads{0};
}  // namespace

// The threads a CPU call made on this thread may use: PSA_MASK_NUM_THREADS if
// it is a positive integer; else Paddle's count (OpenMP's, on this thread);
// else, with no OpenMP, every hardware thread. C linkage: psanet.ops reads it
// through ctypes, with no extra op in the schema.
extern "C" int psa_mask_cpu_threads(void) {
  if (const char* env = std::getenv("PSA_MASK_NUM_THREADS")) {
    const int threads = std::atoi(env);
    if (threads >= 1) return threads;
  }
  if (&omp_get_max_threads != nullptr) return std::max(omp_get_max_threads(), 1);
  return std::max(static_cast<int>(std::thread::hardware_concurrency()), 1);
}

extern "C" int psa_mask_last_cpu_threads(void) { return last_cpu_threads.load(); }

namespace {

int thread_count(int64_t units, int64_t elements) {
  // Spawning threads costs tens of microseconds: small ops stay on one.
  constexpr int64_t kMinElementsPerThread = 1 << 16;
  int64_t threads = psa_mask_cpu_threads();
  threads = std::min<int64_t>(threads, units);
  threads = std::min<int64_t>(
      threads, std::max<int64_t>(elements / kMinElementsPerThread, 1));
  return static_cast<int>(std::max<int64_t>(threads, 1));
}

// Runs fn(begin, end) over [0, units) split in contiguous ranges, one per thread,
// so that each thread sets up its scratch once.
template <typename Fn>
void parallel_for(int64_t units, int64_t elements, const Fn& fn) {
  const int threads = thread_count(units, elements);
  last_cpu_threads.store(threads);
  if (threads <= 1) {
    fn(int64_t{0}, units);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  auto run_range = [&](int t) { fn(units * t / threads, units * (t + 1) / threads); };
  for (int t = 1; t < threads; ++t) pool.emplace_back(run_range, t);
  run_range(0);
  for (auto& thread : pool) thread.join();
}

// Outputs at least this large go out with non-temporal stores: they cannot
// stay in cache for the next op anyway, and streaming skips reading every
// line before it is overwritten.
constexpr int64_t kStreamBytes = int64_t{16} << 20;

template <typename T>
bool stream_output(int64_t numel, int64_t feature_w) {
  // Rows shorter than a cache line would leave partial lines.
  return numel * static_cast<int64_t>(sizeof(T)) >= kStreamBytes &&
         feature_w * static_cast<int64_t>(sizeof(T)) >= 64;
}

template <typename T>
void copy_out(T* dst, const T* src, int64_t n, bool stream) {
#if defined(__SSE2__)
  if (stream && (sizeof(T) == 4 || sizeof(T) == 8)) {
    int64_t k = 0;
    for (; k < n && (reinterpret_cast<uintptr_t>(dst + k) & 15); ++k) dst[k] = src[k];
    constexpr int64_t kLanes = 16 / sizeof(T);
    for (; k + kLanes <= n; k += kLanes) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k)));
    }
    for (; k < n; ++k) dst[k] = src[k];
    return;
  }
#endif
  std::copy(src, src + n, dst);
}

// Streaming stores are weakly ordered: fence before the thread reports done.
inline void stream_fence(bool stream) {
#if defined(__SSE2__)
  if (stream) _mm_sfence();
#endif
}

// A large output is fresh memory from the allocator, and faulting it in 4 KiB
// pages can cost more than the kernel itself: ask for 2 MiB pages. A hint
// only; without transparent huge pages nothing changes.
constexpr int64_t kHugePageBytes = int64_t{2} << 20;

inline void advise_huge_pages(void* data, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes < 4 * kHugePageBytes) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePageBytes - 1) &
                          ~static_cast<uintptr_t>(kHugePageBytes - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) &
                        ~static_cast<uintptr_t>(kHugePageBytes - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
}

// Rows read ahead of use. The kernels read rows of W values lying H*W apart,
// a stride the hardware prefetcher does not follow.
constexpr int64_t kPrefetchRows = 8;

template <typename T>
inline void prefetch_row(const T* row, int64_t n) {
  const char* begin = reinterpret_cast<const char*>(row);
  const char* end = reinterpret_cast<const char*>(row + n);
  for (const char* line = begin; line < end; line += 64) __builtin_prefetch(line);
}

// Y[n] is cut into W x W tiles; tile (r, c) holds rows r*W.. and columns c*W..
// and depends on one window row i only, whose mask_w x-rows it reads in full.
//   collect:    Y row q = (r, u), column p = (c, v), i = window_row(r - c),
//               tile[u][v] = x[(i, window_column(u - v)), c, v]
//   distribute: Y row p = (r, u), column q = (c, v), i = window_row(c - r),
//               tile[u][v] = x[(i, window_column(v - u)), r, u]
// The backward reads the same tile of grad_y back into the same x rows. The
// window geometry (window_row, column_shift, first_column, ...) is
// psa_mask_kernel.h's, the CUDA kernels' too.
struct Tile {
  int64_t i;       // window row, or out of [0, mask_h) for an all-zero tile
  int64_t x_row;   // the row h of x the tile reads (collect: c, distribute: r)
};

inline Tile tile_of(const psa_mask::Geometry& g, bool collect, int64_t r, int64_t c) {
  return collect ? Tile{psa_mask::window_row(g, r - c), c}
                 : Tile{psa_mask::window_row(g, c - r), r};
}

// Index in the tile of the entry that window column j and x column w map to:
// collect tile[w + column_shift(j)][w], distribute tile[w][w + column_shift(j)].
inline int64_t tile_offset(const psa_mask::Geometry& g, bool collect, int64_t j) {
  const int64_t shift = psa_mask::column_shift(g, j);
  return collect ? shift * g.feature_w : shift;
}

// Forward. A work unit is the block of W rows of Y[n] at row position r (W*H*W
// contiguous values): each tile is built in cache, x rows read whole and in
// order, then written out row by row. Units never share output memory.
template <typename T>
void psa_mask_forward_cpu(const T* x, T* y, const psa_mask::Geometry& g, int psa_type) {
  const int64_t H = g.feature_h, W = g.feature_w, hw = g.positions();
  const bool collect = psa_type == psa_mask::kCollect;
  const bool stream = stream_output<T>(g.y_numel(), W);
  advise_huge_pages(y, g.y_numel() * static_cast<int64_t>(sizeof(T)));
  parallel_for(g.num * H, g.y_numel(), [&](int64_t begin, int64_t end) {
    std::vector<T> tile(W * W);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t n = unit / H, r = unit - n * H;
      T* y_rows = y + (n * hw + r * W) * hw;
      for (int64_t c = 0; c < H; ++c) {
        std::fill(tile.begin(), tile.end(), static_cast<T>(0));
        const Tile t = tile_of(g, collect, r, c);
        if (t.i >= 0 && t.i < g.mask_h) {
          const T* x_rows = x + ((n * g.mask_h + t.i) * g.mask_w * H + t.x_row) * W;
          for (int64_t j = 0; j < std::min(kPrefetchRows, g.mask_w); ++j) {
            prefetch_row(x_rows + j * hw, W);
          }
          for (int64_t j = 0; j < g.mask_w; ++j) {
            if (j + kPrefetchRows < g.mask_w) {
              prefetch_row(x_rows + (j + kPrefetchRows) * hw, W);
            }
            const T* source = x_rows + j * hw;
            const int64_t offset = tile_offset(g, collect, j);
            const int64_t w_end = psa_mask::end_column(g, j);
            for (int64_t w = psa_mask::first_column(g, j); w < w_end; ++w) {
              tile[offset + w * (W + 1)] = source[w];
            }
          }
        }
        for (int64_t u = 0; u < W; ++u) {
          copy_out(y_rows + u * hw + c * W, tile.data() + u * W, W, stream);
        }
      }
    }
    stream_fence(stream);
  });
}

// Backward: the matching gather. A work unit is x row b of the channels of
// window row i (one sample): its tile of grad_y is copied into cache (whole
// rows, in order), then each channel's row is read off its diagonal into a
// block of mask_w rows, one cache line of x columns at a time for every
// channel: a line's diagonals cross mask_w plus a line of tile rows, one cache
// line of each (a few KiB, which stays close), where whole-row diagonals walk
// the whole tile for every channel. The block then goes out row by row. Its
// off-map cells are the same columns in every unit: zeroed once when the block
// is made, never written, so there is no zero pass. (Streaming each line
// straight out, 64 bytes per channel, measured slower than whole rows.)
template <typename T>
void psa_mask_backward_cpu(const T* grad_y, T* grad_x, const psa_mask::Geometry& g,
                           int psa_type) {
  const int64_t H = g.feature_h, W = g.feature_w, hw = g.positions();
  const bool collect = psa_type == psa_mask::kCollect;
  const bool stream = stream_output<T>(g.x_numel(), W);
  constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(T));
  advise_huge_pages(grad_x, g.x_numel() * static_cast<int64_t>(sizeof(T)));
  parallel_for(g.num * g.mask_h * H, g.x_numel(), [&](int64_t begin, int64_t end) {
    std::vector<T> tile(W * W);
    const std::vector<T> zeros(W, static_cast<T>(0));
    std::vector<T> rows(g.mask_w * W, static_cast<T>(0));
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t n = unit / (g.mask_h * H);
      const int64_t i = unit / H - n * g.mask_h;
      const int64_t b = unit - unit / H * H;
      // The other end of the cells: row qh of the map, maybe off it.
      const int64_t qh = psa_mask::target_row(g, b, i);
      T* out = grad_x + ((n * g.mask_h + i) * g.mask_w * H + b) * W;
      if (qh < 0 || qh >= H) {
        for (int64_t j = 0; j < g.mask_w; ++j) copy_out(out + j * hw, zeros.data(), W, stream);
        continue;
      }
      const int64_t r = collect ? qh : b, c = collect ? b : qh;
      const T* source = grad_y + (n * hw + r * W) * hw + c * W;
      for (int64_t u = 0; u < std::min(kPrefetchRows, W); ++u) prefetch_row(source + u * hw, W);
      for (int64_t u = 0; u < W; ++u) {
        if (u + kPrefetchRows < W) prefetch_row(source + (u + kPrefetchRows) * hw, W);
        std::copy(source + u * hw, source + u * hw + W, tile.begin() + u * W);
      }
      for (int64_t w0 = 0; w0 < W; w0 += kLine) {
        const int64_t w1 = std::min(w0 + kLine, W);
        for (int64_t j = 0; j < g.mask_w; ++j) {
          const int64_t offset = tile_offset(g, collect, j);
          const int64_t w_begin = std::max(psa_mask::first_column(g, j), w0);
          const int64_t w_end = std::min(psa_mask::end_column(g, j), w1);
          T* channel = rows.data() + j * W;
          for (int64_t w = w_begin; w < w_end; ++w) channel[w] = tile[offset + w * (W + 1)];
        }
      }
      for (int64_t j = 0; j < g.mask_w; ++j) {
        copy_out(out + j * hw, rows.data() + j * W, W, stream);
      }
    }
    stream_fence(stream);
  });
}

}  // namespace

std::vector<paddle::Tensor> psa_mask_cpu_forward(const paddle::Tensor& x, int psa_type,
                                                 int mask_h, int mask_w) {
  const auto g = psa_mask::geometry_of(x, mask_h, mask_w);
  // A copy (shared storage): contiguous() is const only from Paddle 3.1.1
  // (psanet.compat.CONST_CONTIGUOUS).
  const auto input = paddle::Tensor(x).contiguous();
  auto y = psa_mask::empty_y(g, x);
  if (x.dtype() == phi::DataType::FLOAT32) {
    psa_mask_forward_cpu<float>(input.data<float>(), y.data<float>(), g, psa_type);
  } else {
    psa_mask_forward_cpu<double>(input.data<double>(), y.data<double>(), g, psa_type);
  }
  return {y};
}

std::vector<paddle::Tensor> psa_mask_cpu_backward(const paddle::Tensor& grad_y,
                                                  int psa_type, int mask_h, int mask_w) {
  const auto g = psa_mask::geometry_of(grad_y, mask_h, mask_w);
  const auto grad_out = paddle::Tensor(grad_y).contiguous();  // as above
  auto grad_x = psa_mask::empty_grad_x(g, grad_y);
  if (grad_y.dtype() == phi::DataType::FLOAT32) {
    psa_mask_backward_cpu<float>(grad_out.data<float>(), grad_x.data<float>(), g,
                                 psa_type);
  } else {
    psa_mask_backward_cpu<double>(grad_out.data<double>(), grad_x.data<double>(), g,
                                  psa_type);
  }
  return {grad_x};
}

// The float32 backward kernel alone, into memory the caller owns, for
// bench/bench_psa_mask.py (psanet.ops.psa_mask_cpu_backward_into): it times
// the kernel without Paddle's copy of the output gradient or a fresh
// allocation. Shapes as the op's; the caller checks them.
extern "C" void psa_mask_cpu_backward_float(const float* grad_y, float* grad_x, int64_t num,
                                            int64_t feature_h, int64_t feature_w,
                                            int64_t mask_h, int64_t mask_w, int psa_type) {
  psa_mask_backward_cpu<float>(
      grad_y, grad_x, psa_mask::make_geometry(num, feature_h, feature_w, mask_h, mask_w),
      psa_type);
}
