// The window geometry, the index math and the CUDA kernels of the point-wise
// spatial attention (PSA) mask op.
//
// This header knows nothing of Paddle: the Paddle op (psa_mask.cc, psa_mask_cpu.cc,
// psa_mask.cu), the standalone GPU harness (tests/gpu/psa_mask_capi.cu) and the
// CPU grid emulator (tests/gpu/psa_mask_emulator.cc) include the very same
// geometry, and the last two the very same kernels.
//
// Layout (the same as mmcv's and semseg's psamask):
//   x: [N, mask_h * mask_w, H, W], channel k = i * mask_w + j is window cell (i, j).
//   y: [N, H * W, H, W], read as Y[n, a, b], positions flattened p = h * W + w.
// Cell (i, j) predicted at p = (h, w) points at q = (h + i - half_h, w + j - half_w).
//   collect    (0): Y[n, q, p] = x[n, k, h, w]
//   distribute (1): Y[n, p, q] = x[n, k, h, w]
// Every other entry of y is 0; cells whose q falls outside the map are dropped.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)
#define PSA_MASK_HOST_DEVICE __host__ __device__ __forceinline__
// Lets a warp have several of its staging loads in flight.
#define PSA_MASK_UNROLL_4 _Pragma("unroll 4")
#else
#define PSA_MASK_HOST_DEVICE inline
#define PSA_MASK_UNROLL_4
#endif

namespace psa_mask {

// The op's psa_type values, mirroring COLLECT and DISTRIBUTE in psanet/ops/psa_mask.py.
constexpr int kCollect = 0;
constexpr int kDistribute = 1;

struct Geometry {
  int64_t num;
  int64_t feature_h;
  int64_t feature_w;
  int64_t mask_h;
  int64_t mask_w;
  int64_t half_h;
  int64_t half_w;

  PSA_MASK_HOST_DEVICE int64_t positions() const { return feature_h * feature_w; }
  PSA_MASK_HOST_DEVICE int64_t x_numel() const {
    return num * mask_h * mask_w * positions();
  }
  PSA_MASK_HOST_DEVICE int64_t y_numel() const {
    return num * positions() * positions();
  }
};

inline Geometry make_geometry(int64_t num, int64_t feature_h, int64_t feature_w,
                              int64_t mask_h, int64_t mask_w) {
  // Floor of (mask - 1) / 2: an even mask gives a lopsided window.
  return Geometry{num,    feature_h,          feature_w,         mask_h,
                  mask_w, (mask_h - 1) / 2, (mask_w - 1) / 2};
}

// The window, both ways. Cell (i, j) predicted at (h, w) points at
// (target_row(h, i), target_column(w, j)), a shift of column_shift(j) along the
// row; a shift (dh, dw) is cell (window_row(dh), window_column(dw)), off the
// window unless in [0, mask_h) x [0, mask_w). Every kernel, CPU and CUDA,
// takes its geometry from these and the column range below.
PSA_MASK_HOST_DEVICE int64_t target_row(const Geometry& g, int64_t h, int64_t i) {
  return h + i - g.half_h;
}
PSA_MASK_HOST_DEVICE int64_t target_column(const Geometry& g, int64_t w, int64_t j) {
  return w + j - g.half_w;
}
PSA_MASK_HOST_DEVICE int64_t column_shift(const Geometry& g, int64_t j) {
  return j - g.half_w;
}
PSA_MASK_HOST_DEVICE int64_t window_row(const Geometry& g, int64_t dh) { return dh + g.half_h; }
PSA_MASK_HOST_DEVICE int64_t window_column(const Geometry& g, int64_t dw) {
  return dw + g.half_w;
}

// Map columns w whose target_column(w, j) is on the map: [first_column,
// end_column), both in [0, W] (empty where the window is wider than the map).
// Host only: the CPU kernels walk these ranges, the CUDA kernels test each element.
inline int64_t first_column(const Geometry& g, int64_t j) {
  return std::min(std::max<int64_t>(0, g.half_w - j), g.feature_w);
}
inline int64_t end_column(const Geometry& g, int64_t j) {
  return std::max(std::min(g.feature_w, g.feature_w + g.half_w - j), first_column(g, j));
}

// The definition, one element at a time. The tiled kernels below do not use
// these; the baseline kernels of tests/gpu/ (one thread per output element)
// do, and the pure-Paddle gather (psanet/ops/psa_mask.py) mirrors y_source.
//
// Index into x of the value that y[y_index] holds, or -1 where y holds 0.
PSA_MASK_HOST_DEVICE int64_t y_source(const Geometry& g, int psa_type,
                                      int64_t y_index) {
  const int64_t hw = g.positions();
  const int64_t n = y_index / (hw * hw);
  const int64_t rest = y_index - n * hw * hw;
  const int64_t row = rest / hw;
  const int64_t col = rest - row * hw;
  const int64_t p = psa_type == kCollect ? col : row;
  const int64_t q = psa_type == kCollect ? row : col;
  const int64_t ph = p / g.feature_w, pw = p - ph * g.feature_w;
  const int64_t qh = q / g.feature_w, qw = q - qh * g.feature_w;
  const int64_t i = window_row(g, qh - ph);
  const int64_t j = window_column(g, qw - pw);
  if (i < 0 || i >= g.mask_h || j < 0 || j >= g.mask_w) return -1;
  return ((n * g.mask_h * g.mask_w + i * g.mask_w + j) * hw) + p;
}

// Index into y whose gradient flows back to x[x_index], or -1 where the cell
// points outside the map (its gradient is 0).
PSA_MASK_HOST_DEVICE int64_t x_target(const Geometry& g, int psa_type,
                                      int64_t x_index) {
  const int64_t hw = g.positions();
  const int64_t cells = g.mask_h * g.mask_w;
  const int64_t n = x_index / (cells * hw);
  const int64_t rest = x_index - n * cells * hw;
  const int64_t k = rest / hw;
  const int64_t p = rest - k * hw;
  const int64_t i = k / g.mask_w, j = k - i * g.mask_w;
  const int64_t h = p / g.feature_w, w = p - h * g.feature_w;
  const int64_t qh = target_row(g, h, i);
  const int64_t qw = target_column(g, w, j);
  if (qh < 0 || qh >= g.feature_h || qw < 0 || qw >= g.feature_w) return -1;
  const int64_t q = qh * g.feature_w + qw;
  return psa_type == kCollect ? (n * hw + q) * hw + p : (n * hw + p) * hw + q;
}

// ---------------------------------------------------------------------------
// The tiled kernels (docs/psa_mask.md, "The CUDA kernels").
//
// For a target row qh and a source row ph the window row is fixed,
// i = window_row(qh - ph), and the W x W block of Y[n] that the two rows
// address is a shear of one slab of x, x[n, (i, j), ph, :]: entry (qw, pw)
// holds x[n, (i, j), ph, pw] with j = window_column(qw - pw), or 0 off the
// window. One thread block handles one tile of that block: kTileColumns
// source columns pw (one per lane of a warp) by `span` target columns qw
// (forward) or window columns j (backward). It stages the part of the slab
// (forward: of x; backward: of grad_Y) the tile reaches in shared memory,
// every element read once and coalesced, then, after a barrier, writes every
// element of its tile of the output, zeros included, coalesced again, taking
// each value from shared memory. Tiles partition the output, so nothing else
// writes it and no zero fill runs before.
//
// Each kernel is a list of phases between barriers; a phase is a
// __host__ __device__ function of (tile, thread, shared slab) that reaches
// memory only through the load_if / store_if of a view. On the GPU the views
// are plain pointers (launch_* below); the CPU grid emulator runs the same
// phases over every block and thread, through views that check and record
// each access (bounds, races between threads of a phase, bank conflicts,
// sectors per warp request, reads and writes per element).
//
// Accesses are predicated (load_if / store_if) and every loop's trip count is
// the same across the 32 lanes of a warp, so the lanes of a warp make the same
// sequence of calls: the k-th call of each lane is one warp-wide request.
// ---------------------------------------------------------------------------

constexpr int kForward = 0;
constexpr int kBackward = 1;

// A block is kWarps warps of kTileColumns lanes (threadIdx.x: the lane, threadIdx.y:
// the warp). A tile spans at most kMaxSpan target (forward) or window (backward)
// columns, so that the slab fits in 48 KiB of shared memory for every element size
// (kMaxSharedBytes below): no opt-in attribute needed, and wide maps or masks take
// several tiles.
constexpr int kTileColumns = 32;
constexpr int kWarps = 8;
constexpr int kThreads = kTileColumns * kWarps;
constexpr int64_t kMaxSpan = 128;
constexpr int64_t kMaxGridX = 2147483647;  // 2^31 - 1 blocks; grid y holds the rest
constexpr int64_t kMaxGridY = 65535;
// Dynamic shared memory a block gets without cudaFuncAttributeMaxDynamicSharedMemorySize.
constexpr int64_t kSharedBytesLimit = 48 * 1024;

PSA_MASK_HOST_DEVICE int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
PSA_MASK_HOST_DEVICE int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The kernels only move values: they work on unsigned integers of the element's
// size (float16 as 16 bits), so every dtype's bits, NaN payloads and -0.0
// included, arrive unchanged, and 0 bits are +0.0.
template <int Bytes> struct BitsOf;
template <> struct BitsOf<2> { using type = uint16_t; };
template <> struct BitsOf<4> { using type = uint32_t; };
template <> struct BitsOf<8> { using type = uint64_t; };

// Shared memory has 32 banks of 4-byte words; the lanes of a warp request
// distinct banks (one pass, two for 8-byte elements) when consecutive lanes
// are an odd number of words apart: an odd stride in elements for 4- and
// 8-byte elements, twice an odd number for 2-byte ones.
inline bool conflict_free_stride(int64_t stride, int element_bytes) {
  stride = stride < 0 ? -stride : stride;
  return element_bytes == 2 ? stride % 4 == 2 : stride % 2 == 1;
}

// The smallest pitch >= least for which lanes pitch + skew elements apart are
// conflict-free.
inline int64_t conflict_free_pitch(int64_t least, int64_t skew, int element_bytes) {
  int64_t pitch = least;
  while (!conflict_free_stride(pitch + skew, element_bytes)) ++pitch;
  return pitch;
}

// How one launch cuts its output into tiles, one block each.
struct Plan {
  Geometry g;
  int psa_type;
  int direction;
  int element_bytes;
  int64_t span;             // target (forward) or window (backward) columns of a tile
  int64_t column_tiles;     // tiles of kTileColumns source columns across the map
  int64_t span_tiles;       // tiles of `span` across the map (forward) or mask (backward)
  int64_t pitch;            // elements from one staged row to the next
  int64_t shared_elements;  // of the slab
  int64_t units;            // tiles in all
  int64_t grid_x, grid_y;   // unit = blockIdx.y * grid_x + blockIdx.x

  PSA_MASK_HOST_DEVICE int64_t shared_bytes() const { return shared_elements * element_bytes; }
  bool fits_grid() const { return grid_y <= kMaxGridY; }
};

// The staged rows of a tile: forward the window columns j, backward the target
// columns qw, that a tile of span x kTileColumns reaches, both at most
// span + kTileColumns - 1. Staging walks consecutive elements of a slab row; the
// write phase crosses rows, lanes a stride apart that the pitch makes
// conflict-free:
//   forward collect     slab[j][pw], lanes on pw (j falls by 1): stride pitch - 1
//   forward distribute  slab[j][pw], lanes on qw (j rises by 1): stride pitch
//   backward collect    slab[qw][pw], lanes on pw (qw rises by 1): stride pitch + 1
//   backward distribute slab[pw][qw], lanes on pw (both rise by 1): stride pitch + 1
// max_grid_x is kMaxGridX but in tests, which lower it to run the grid's second dimension.
inline Plan make_plan(const Geometry& g, int psa_type, int direction, int element_bytes,
                      int64_t max_grid_x = kMaxGridX) {
  Plan p{};
  p.g = g;
  p.psa_type = psa_type;
  p.direction = direction;
  p.element_bytes = element_bytes;
  const bool forward = direction == kForward;
  const int64_t across = forward ? g.feature_w : g.mask_w;
  p.span = std::max<int64_t>(1, std::min(across, kMaxSpan));
  p.column_tiles = ceil_div(g.feature_w, kTileColumns);
  p.span_tiles = ceil_div(across, p.span);
  const int64_t rows = std::min(forward ? g.mask_w : g.feature_w, p.span + kTileColumns - 1);
  if (forward) {
    p.pitch = conflict_free_pitch(kTileColumns, psa_type == kCollect ? -1 : 0, element_bytes);
    p.shared_elements = rows * p.pitch;
  } else if (psa_type == kCollect) {
    p.pitch = conflict_free_pitch(kTileColumns, 1, element_bytes);
    p.shared_elements = rows * p.pitch;
  } else {
    p.pitch = conflict_free_pitch(rows, 1, element_bytes);
    p.shared_elements = kTileColumns * p.pitch;
  }
  p.units = g.num * (forward ? g.feature_h : g.mask_h) * g.feature_h * p.span_tiles *
            p.column_tiles;
  p.grid_x = std::max<int64_t>(1, std::min(p.units, max_grid_x));
  p.grid_y = ceil_div(p.units, p.grid_x);
  return p;
}

// The largest slab: 8-byte elements, kMaxSpan + kTileColumns - 1 staged rows by
// kTileColumns, either side padded by at most 3 for the pitch.
constexpr int64_t kMaxSharedBytes =
    (kMaxSpan + kTileColumns - 1 + 4) * (kTileColumns + 4) * 8;
static_assert(kMaxSharedBytes <= kSharedBytesLimit,
              "a tile's slab must fit the shared memory a block gets without opting in");

// Memory as the phases see it. The CPU grid emulator passes views of its own.
template <typename Element>
struct Memory {
  using Bits = typename std::remove_const<Element>::type;
  Element* data;
  PSA_MASK_HOST_DEVICE Bits load_if(bool on, int64_t index) const {
    return on ? data[index] : Bits(0);
  }
  PSA_MASK_HOST_DEVICE void store_if(bool on, int64_t index, Bits value) const {
    if (on) data[index] = value;
  }
};

// Where a unit lies: sample n, the outer row (forward: the target row qh;
// backward: the window row i), the source row ph, and its tiles across.
struct UnitPlace {
  int64_t n, outer, ph, span_tile, column_tile;
};

PSA_MASK_HOST_DEVICE UnitPlace place_of(const Plan& plan, int64_t unit) {
  UnitPlace u;
  u.column_tile = unit % plan.column_tiles;
  unit /= plan.column_tiles;
  u.span_tile = unit % plan.span_tiles;
  unit /= plan.span_tiles;
  u.ph = unit % plan.g.feature_h;
  unit /= plan.g.feature_h;
  const int64_t outer_rows = plan.direction == kForward ? plan.g.feature_h : plan.g.mask_h;
  u.outer = unit % outer_rows;
  u.n = unit / outer_rows;
  return u;
}

// The phases of every kernel: stage a slab of the input in shared memory; after
// a barrier, write the tile of the output from it.
template <typename Kernel>
struct StageThenWrite {
  static constexpr int kPhases = 2;

  template <typename Tile, typename Slab>
  PSA_MASK_HOST_DEVICE void phase(int phase, const Tile& t, int lane, int warp,
                                  const Slab& slab) const {
    const Kernel& kernel = static_cast<const Kernel&>(*this);
    if (phase == 0) {
      kernel.stage(t, lane, warp, slab);
    } else {
      kernel.write(t, lane, warp, slab);
    }
  }
};

// A forward tile: target row qh, source row ph, source columns [pw0, pw0 +
// kTileColumns), target columns [qw0, qw_end); window row i; staged rows
// j_lo .. j_lo + rows - 1 (none where i is off the mask).
struct ForwardTile {
  int64_t n, qh, ph, pw0, qw0, qw_end, i, j_lo, rows;
};

// Forward: Y from x. Phase 0 stages x[n, (i, j), ph, pw] for the j and pw of the
// tile whose target column qw falls in it; phase 1 writes the tile of Y.
template <int kType, typename Bits_, typename In, typename Out>
struct ForwardKernel : StageThenWrite<ForwardKernel<kType, Bits_, In, Out>> {
  using Bits = Bits_;
  using Tile = ForwardTile;
  Plan plan;
  In x;
  Out y;

  PSA_MASK_HOST_DEVICE Tile tile(int64_t unit) const {
    const Geometry& g = plan.g;
    const UnitPlace u = place_of(plan, unit);
    Tile t;
    t.n = u.n;
    t.qh = u.outer;
    t.ph = u.ph;
    t.pw0 = u.column_tile * kTileColumns;
    t.qw0 = u.span_tile * plan.span;
    t.qw_end = min64(t.qw0 + plan.span, g.feature_w);
    t.i = window_row(g, t.qh - t.ph);
    t.j_lo = max64(0, window_column(g, t.qw0 - (t.pw0 + kTileColumns - 1)));
    const int64_t j_hi = min64(g.mask_w - 1, window_column(g, t.qw_end - 1 - t.pw0));
    t.rows = t.i >= 0 && t.i < g.mask_h ? max64(0, j_hi - t.j_lo + 1) : 0;
    return t;
  }

  template <typename Slab>
  PSA_MASK_HOST_DEVICE void stage(const Tile& t, int lane, int warp, const Slab& slab) const {
    const Geometry& g = plan.g;
    const int64_t hw = g.positions();
    const int64_t pw = t.pw0 + lane;
    const int64_t first =
        ((t.n * g.mask_h + t.i) * g.mask_w + t.j_lo) * hw + t.ph * g.feature_w + pw;
    PSA_MASK_UNROLL_4
    for (int64_t r = warp; r < t.rows; r += kWarps) {
      const int64_t qw = target_column(g, pw, t.j_lo + r);
      const bool on = pw < g.feature_w && qw >= t.qw0 && qw < t.qw_end;
      slab.store_if(on, r * plan.pitch + lane, x.load_if(on, first + r * hw));
    }
  }

  template <typename Slab>
  PSA_MASK_HOST_DEVICE void write(const Tile& t, int lane, int warp, const Slab& slab) const {
    const Geometry& g = plan.g;
    const int64_t hw = g.positions();
    if (kType == kCollect) {
      // Rows q = (qh, qw) of Y, kTileColumns consecutive columns p = (ph, pw) each.
      const int64_t pw = t.pw0 + lane;
      const bool on_map = pw < g.feature_w;
      for (int64_t qw = t.qw0 + warp; qw < t.qw_end; qw += kWarps) {
        const int64_t j = window_column(g, qw - pw);
        const bool staged = on_map && j >= t.j_lo && j < t.j_lo + t.rows;
        const Bits value = slab.load_if(staged, (j - t.j_lo) * plan.pitch + lane);
        y.store_if(on_map, ((t.n * hw + t.qh * g.feature_w + qw) * hw) + t.ph * g.feature_w + pw,
                   value);
      }
    } else {
      // Rows p = (ph, pw) of Y, the tile's consecutive columns q = (qh, qw) each.
      const int64_t rows_on_map = min64(kTileColumns, g.feature_w - t.pw0);
      for (int64_t row = warp; row < rows_on_map; row += kWarps) {
        const int64_t pw = t.pw0 + row;
        for (int64_t base = t.qw0; base < t.qw_end; base += kTileColumns) {
          const int64_t qw = base + lane;
          const bool on_map = qw < t.qw_end;
          const int64_t j = window_column(g, qw - pw);
          const bool staged = on_map && j >= t.j_lo && j < t.j_lo + t.rows;
          const Bits value = slab.load_if(staged, (j - t.j_lo) * plan.pitch + row);
          y.store_if(on_map, ((t.n * hw + t.ph * g.feature_w + pw) * hw) + t.qh * g.feature_w + qw,
                     value);
        }
      }
    }
  }
};

// A backward tile: window row i, source row ph, source columns [pw0, pw0 +
// kTileColumns), window columns [j0, j_end); the target row qh they point at;
// staged target columns qw_lo .. qw_lo + rows - 1 (none where qh is off the map).
struct BackwardTile {
  int64_t n, i, ph, pw0, j0, j_end, qh, qw_lo, rows;
};

// Backward: grad_x from grad_Y. Phase 0 stages the entries of grad_Y whose cell
// (i, j) falls in the tile; phase 1 writes the tile of grad_x, 0 for cells off the map.
template <int kType, typename Bits_, typename In, typename Out>
struct BackwardKernel : StageThenWrite<BackwardKernel<kType, Bits_, In, Out>> {
  using Bits = Bits_;
  using Tile = BackwardTile;
  Plan plan;
  In grad_y;
  Out grad_x;

  PSA_MASK_HOST_DEVICE Tile tile(int64_t unit) const {
    const Geometry& g = plan.g;
    const UnitPlace u = place_of(plan, unit);
    Tile t;
    t.n = u.n;
    t.i = u.outer;
    t.ph = u.ph;
    t.pw0 = u.column_tile * kTileColumns;
    t.j0 = u.span_tile * plan.span;
    t.j_end = min64(t.j0 + plan.span, g.mask_w);
    t.qh = target_row(g, t.ph, t.i);
    t.qw_lo = max64(0, target_column(g, t.pw0, t.j0));
    const int64_t qw_hi =
        min64(g.feature_w - 1, target_column(g, t.pw0 + kTileColumns - 1, t.j_end - 1));
    t.rows = t.qh >= 0 && t.qh < g.feature_h ? max64(0, qw_hi - t.qw_lo + 1) : 0;
    return t;
  }

  // The index in grad_Y of entry (q = (qh, qw), p = (ph, pw)) of the tile.
  PSA_MASK_HOST_DEVICE int64_t grad_y_index(const Tile& t, int64_t qw, int64_t pw) const {
    const Geometry& g = plan.g;
    const int64_t hw = g.positions();
    const int64_t q = t.qh * g.feature_w + qw, p = t.ph * g.feature_w + pw;
    return kType == kCollect ? (t.n * hw + q) * hw + p : (t.n * hw + p) * hw + q;
  }

  template <typename Slab>
  PSA_MASK_HOST_DEVICE void stage(const Tile& t, int lane, int warp, const Slab& slab) const {
    const Geometry& g = plan.g;
    if (kType == kCollect) {
      // Rows q of grad_Y, kTileColumns consecutive columns p each: slab[qw][pw].
      const int64_t pw = t.pw0 + lane;
      PSA_MASK_UNROLL_4
      for (int64_t r = warp; r < t.rows; r += kWarps) {
        const int64_t qw = t.qw_lo + r;
        const int64_t j = window_column(g, qw - pw);
        const bool on = pw < g.feature_w && j >= t.j0 && j < t.j_end;
        slab.store_if(on, r * plan.pitch + lane, grad_y.load_if(on, grad_y_index(t, qw, pw)));
      }
    } else {
      // Rows p of grad_Y, the tile's consecutive columns q each: slab[pw][qw].
      const int64_t rows_on_map = min64(kTileColumns, g.feature_w - t.pw0);
      for (int64_t row = warp; row < rows_on_map; row += kWarps) {
        const int64_t pw = t.pw0 + row;
        PSA_MASK_UNROLL_4
        for (int64_t base = 0; base < t.rows; base += kTileColumns) {
          const int64_t r = base + lane;
          const int64_t j = window_column(g, t.qw_lo + r - pw);
          const bool on = r < t.rows && j >= t.j0 && j < t.j_end;
          slab.store_if(on, row * plan.pitch + r,
                        grad_y.load_if(on, grad_y_index(t, t.qw_lo + r, pw)));
        }
      }
    }
  }

  template <typename Slab>
  PSA_MASK_HOST_DEVICE void write(const Tile& t, int lane, int warp, const Slab& slab) const {
    const Geometry& g = plan.g;
    const int64_t pw = t.pw0 + lane;
    const bool on_map = pw < g.feature_w;
    const int64_t first = ((t.n * g.mask_h + t.i) * g.mask_w) * g.positions() +
                          t.ph * g.feature_w + pw;
    for (int64_t j = t.j0 + warp; j < t.j_end; j += kWarps) {
      const int64_t r = target_column(g, pw, j) - t.qw_lo;
      const bool staged = on_map && r >= 0 && r < t.rows;
      const int64_t slot = kType == kCollect ? r * plan.pitch + lane : lane * plan.pitch + r;
      grad_x.store_if(on_map, first + j * g.positions(), slab.load_if(staged, slot));
    }
  }
};

// Calls fn(kernel) with the kernel of the plan's direction and psa_type over
// the views `in` and `out` of elements Bits: the one dispatch the CUDA launcher
// and the CPU grid emulator share.
template <typename Bits, typename In, typename Out, typename Fn>
auto with_kernel(const Plan& plan, const In& in, const Out& out, Fn&& fn) {
  if (plan.direction == kForward) {
    if (plan.psa_type == kCollect) {
      return fn(ForwardKernel<kCollect, Bits, In, Out>{{}, plan, in, out});
    }
    return fn(ForwardKernel<kDistribute, Bits, In, Out>{{}, plan, in, out});
  }
  if (plan.psa_type == kCollect) {
    return fn(BackwardKernel<kCollect, Bits, In, Out>{{}, plan, in, out});
  }
  return fn(BackwardKernel<kDistribute, Bits, In, Out>{{}, plan, in, out});
}

#if defined(__CUDACC__)

// One block per tile: its phases, a barrier between each two.
template <typename Kernel>
__global__ void __launch_bounds__(kThreads) psa_mask_tile_kernel(const Kernel kernel) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  const int64_t unit = static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x;
  if (unit >= kernel.plan.units) return;  // the end of the grid's last row: the whole block
  const typename Kernel::Tile tile = kernel.tile(unit);
  const Memory<typename Kernel::Bits> slab{reinterpret_cast<typename Kernel::Bits*>(shared_bytes)};
#pragma unroll
  for (int phase = 0; phase < Kernel::kPhases; ++phase) {
    if (phase > 0) __syncthreads();
    kernel.phase(phase, tile, threadIdx.x, threadIdx.y, slab);
  }
}

// Forward (x -> y) or backward (grad_y -> grad_x) of any element type of 2, 4
// or 8 bytes. max_grid_x: see make_plan.
template <typename T>
cudaError_t launch_psa_mask(int direction, const T* input, T* output, const Geometry& g,
                            int psa_type, cudaStream_t stream, int64_t max_grid_x = kMaxGridX) {
  using Bits = typename BitsOf<sizeof(T)>::type;
  const Plan plan = make_plan(g, psa_type, direction, sizeof(T), max_grid_x);
  if (plan.units == 0) return cudaSuccess;
  if (!plan.fits_grid()) return cudaErrorInvalidConfiguration;
  const Memory<const Bits> in{reinterpret_cast<const Bits*>(input)};
  const Memory<Bits> out{reinterpret_cast<Bits*>(output)};
  return with_kernel<Bits>(plan, in, out, [&](const auto& kernel) {
    using Kernel = typename std::decay<decltype(kernel)>::type;
    psa_mask_tile_kernel<Kernel>
        <<<dim3(static_cast<unsigned int>(plan.grid_x), static_cast<unsigned int>(plan.grid_y)),
           dim3(kTileColumns, kWarps), static_cast<size_t>(plan.shared_bytes()), stream>>>(kernel);
    return cudaGetLastError();
  });
}

template <typename T>
cudaError_t launch_psa_mask_forward(const T* x, T* y, const Geometry& g, int psa_type,
                                    cudaStream_t stream) {
  return launch_psa_mask(kForward, x, y, g, psa_type, stream);
}

template <typename T>
cudaError_t launch_psa_mask_backward(const T* grad_y, T* grad_x, const Geometry& g,
                                     int psa_type, cudaStream_t stream) {
  return launch_psa_mask(kBackward, grad_y, grad_x, g, psa_type, stream);
}

#endif  // __CUDACC__

}  // namespace psa_mask
