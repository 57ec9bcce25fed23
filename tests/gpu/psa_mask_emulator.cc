// CPU grid emulator of the PSA mask CUDA kernels: the phases of
// ops/psa_mask_kernel.h run for every block of the grid and, a phase at a time,
// for every thread of the block (in a shuffled order) before the next phase,
// as the GPU runs them between barriers. Built with the host compiler alone
// (no nvcc, no Paddle) and called through ctypes by tests/gpu/emulator.py.
//
// What it sees besides the output, through the memory views it hands the phases:
// - every access in bounds (an access out of bounds is counted and skipped);
// - shared memory poisoned before each block, so a value read before a thread
//   of the block wrote it shows in the output; with `instrument` also:
// - a shared slot read before any thread of the block wrote it, or written and
//   read (or written twice) by two threads within one phase: a race, which a
//   barrier between the two would have prevented;
// - the reads of each input element and the writes of each output element;
// - per warp request (the k-th call of the 32 lanes of a warp, which make the
//   same sequence of calls), the passes shared memory needs (32 banks of 4
//   bytes) against the fewest possible, and the 32-byte sectors of global
//   memory it touches against the fewest that could hold its bytes.
#include <algorithm>
#include <array>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <vector>

#include "psa_mask_kernel.h"  // ops/ on the include path: a test may put a changed copy first

namespace {

using psa_mask::kThreads;
using psa_mask::kTileColumns;

// What a run saw; the layout of Stats in tests/gpu/emulator.py.
struct Stats {
  int64_t units, grid_x, grid_y, shared_bytes, pitch, span;
  int64_t out_of_bounds, races, uninitialized_reads, divergent_requests;
  int64_t shared_requests, shared_passes, shared_least_passes, conflicted_requests;
  int64_t load_requests, load_sectors, load_least_sectors;
  int64_t store_requests, store_sectors, store_least_sectors;
  int64_t reads, max_reads_per_element, writes, min_writes_per_element, max_writes_per_element;
};

enum Space : int8_t { kShared, kInput, kOutput };
const char* const kSpaceNames[] = {"shared", "input", "output"};

struct Access {
  Space space;
  bool store;
  bool on;
  int64_t index;
};

// The state of one run: which thread runs, what it did, and the problems seen.
class Context {
 public:
  Context(bool instrument, int element_bytes, int64_t shared_elements, int64_t input_size,
          int64_t output_size, Stats* stats)
      : instrument_(instrument), element_bytes_(element_bytes), stats_(stats) {
    if (instrument_) {
      slots_.resize(static_cast<size_t>(std::max<int64_t>(shared_elements, 1)));
      reads_.assign(static_cast<size_t>(input_size), 0);
      writes_.assign(static_cast<size_t>(output_size), 0);
    }
  }

  const char* first_problem() const { return first_problem_; }

  void begin_unit(int64_t unit) {
    unit_ = unit;
    ++serial_;
  }
  void begin_phase(int phase) {
    phase_ = phase;
    for (auto& log : logs_) log.clear();
  }
  void set_thread(int thread) { thread_ = thread; }

  // Called by the views before each access; false: skip it (off, or out of bounds).
  // Inline and short: the big shapes run without `instrument`.
  bool access(Space space, bool store, bool on, int64_t index, int64_t size) {
    if (instrument_) logs_[thread_].push_back(Access{space, store, on, index});
    if (!on) return false;
    if (index < 0 || index >= size) {
      out_of_bounds(space, store, index, size);
      return false;
    }
    if (instrument_) count(space, store, index);
    return true;
  }

  // After every thread ran the phase: the warp requests it made.
  void end_phase() {
    if (!instrument_) return;
    for (int warp = 0; warp < kThreads / kTileColumns; ++warp) {
      const auto* lanes = &logs_[warp * kTileColumns];
      size_t calls = lanes[0].size();
      for (int lane = 1; lane < kTileColumns; ++lane) {
        if (lanes[lane].size() != calls) {
          ++stats_->divergent_requests;
          problem("warp %d of unit %lld made %zu calls in lane 0 and %zu in lane %d (phase %d)",
                  warp, static_cast<long long>(unit_), calls, lanes[lane].size(), lane, phase_);
          calls = std::min(calls, lanes[lane].size());
        }
      }
      for (size_t k = 0; k < calls; ++k) request(lanes, k, warp);
    }
  }

  // After the last unit: reads and writes per element.
  void count_elements() {
    if (!instrument_) return;
    if (!reads_.empty()) {
      stats_->max_reads_per_element = *std::max_element(reads_.begin(), reads_.end());
    }
    if (!writes_.empty()) {
      const auto range = std::minmax_element(writes_.begin(), writes_.end());
      stats_->min_writes_per_element = *range.first;
      stats_->max_writes_per_element = *range.second;
    }
  }

  void problem(const char* format, ...) {
    if (first_problem_[0] != '\0') return;
    va_list args;
    va_start(args, format);
    std::vsnprintf(first_problem_, sizeof(first_problem_), format, args);
    va_end(args);
  }

 private:
  struct Slot {
    int64_t written = -1, read = -1;  // (serial * 16 + phase) of the last write and read
    int writer = -1, reader = -1;     // reader -2: more than one thread
  };

  __attribute__((noinline)) void out_of_bounds(Space space, bool store, int64_t index,
                                               int64_t size) {
    ++stats_->out_of_bounds;
    problem("%s %s out of bounds: index %lld of %lld (unit %lld, phase %d, thread %d)",
            kSpaceNames[space], store ? "store" : "load", static_cast<long long>(index),
            static_cast<long long>(size), static_cast<long long>(unit_), phase_, thread_);
  }

  __attribute__((noinline)) void count(Space space, bool store, int64_t index) {
    if (space == kShared) {
      track_slot(store, index);
    } else if (space == kInput) {
      ++stats_->reads;
      if (reads_[index] < 255) ++reads_[index];
    } else {
      ++stats_->writes;
      if (writes_[index] < 255) ++writes_[index];
    }
  }

  void track_slot(bool store, int64_t index) {
    Slot& slot = slots_[index];
    const int64_t now = serial_ * 16 + phase_;
    const char* race = nullptr;
    if (store) {
      if (slot.written == now && slot.writer != thread_) race = "written by two threads";
      if (slot.read == now && slot.reader != thread_) {
        race = "written after another thread read it";
      }
      slot.written = now;
      slot.writer = thread_;
    } else {
      if (slot.written < serial_ * 16) {
        ++stats_->uninitialized_reads;
        problem("shared slot %lld read before any thread of unit %lld wrote it (phase %d, "
                "thread %d)", static_cast<long long>(index), static_cast<long long>(unit_),
                phase_, thread_);
      } else if (slot.written == now && slot.writer != thread_) {
        race = "read after another thread wrote it";
      }
      slot.reader = slot.read == now && slot.reader != thread_ ? -2 : thread_;
      slot.read = now;
    }
    if (race != nullptr) {
      ++stats_->races;
      problem("race: shared slot %lld %s within phase %d of unit %lld (thread %d): a barrier "
              "is missing", static_cast<long long>(index), race, phase_,
              static_cast<long long>(unit_), thread_);
    }
  }

  void request(const std::vector<Access>* lanes, size_t k, int warp) {
    const Access& first = lanes[0][k];
    std::vector<int64_t> bytes;  // first byte of each active lane's element
    for (int lane = 0; lane < kTileColumns; ++lane) {
      const Access& a = lanes[lane][k];
      if (a.space != first.space || a.store != first.store) {
        ++stats_->divergent_requests;
        problem("call %zu of warp %d in unit %lld: lane 0 %s %s, lane %d %s %s (phase %d)", k,
                warp, static_cast<long long>(unit_), kSpaceNames[first.space],
                first.store ? "store" : "load", lane, kSpaceNames[a.space],
                a.store ? "store" : "load", phase_);
        return;
      }
      if (a.on) bytes.push_back(a.index * element_bytes_);
    }
    if (bytes.empty()) return;
    if (first.space == kShared) {
      shared_request(bytes, k, warp);
    } else {
      global_request(bytes, first.space == kInput);
    }
  }

  // Passes: the most distinct 4-byte words any one bank holds (one word read by
  // several lanes is one broadcast); the fewest: the words over 32 banks.
  void shared_request(const std::vector<int64_t>& bytes, size_t k, int warp) {
    std::vector<int64_t> words;
    for (int64_t byte : bytes) {
      for (int64_t word = byte / 4; word <= (byte + element_bytes_ - 1) / 4; ++word) {
        words.push_back(word);
      }
    }
    std::sort(words.begin(), words.end());
    words.erase(std::unique(words.begin(), words.end()), words.end());
    std::array<int64_t, 32> per_bank{};
    for (int64_t word : words) ++per_bank[word % 32];
    const int64_t passes = *std::max_element(per_bank.begin(), per_bank.end());
    const int64_t least = (static_cast<int64_t>(words.size()) + 31) / 32;
    ++stats_->shared_requests;
    stats_->shared_passes += passes;
    stats_->shared_least_passes += least;
    if (passes > least) {
      ++stats_->conflicted_requests;
      problem("bank conflict: call %zu of warp %d in phase %d of unit %lld takes %lld passes, "
              "%lld would do (lanes 0 and 1 at elements %lld and %lld)", k, warp, phase_,
              static_cast<long long>(unit_), static_cast<long long>(passes),
              static_cast<long long>(least), static_cast<long long>(bytes[0] / element_bytes_),
              static_cast<long long>(bytes.size() > 1 ? bytes[1] / element_bytes_ : -1));
    }
  }

  // Sectors: the 32-byte pieces of a buffer (its start aligned, as cudaMalloc's)
  // the active lanes touch; the fewest: their bytes in whole sectors.
  void global_request(const std::vector<int64_t>& bytes, bool load) {
    std::vector<int64_t> sectors;
    for (int64_t byte : bytes) sectors.push_back(byte / 32);
    std::sort(sectors.begin(), sectors.end());
    const int64_t touched = std::unique(sectors.begin(), sectors.end()) - sectors.begin();
    const int64_t least = (static_cast<int64_t>(bytes.size()) * element_bytes_ + 31) / 32;
    if (load) {
      ++stats_->load_requests;
      stats_->load_sectors += touched;
      stats_->load_least_sectors += least;
    } else {
      ++stats_->store_requests;
      stats_->store_sectors += touched;
      stats_->store_least_sectors += least;
    }
  }

  bool instrument_;
  int element_bytes_;
  Stats* stats_;
  int64_t unit_ = -1, serial_ = 0;
  int phase_ = 0, thread_ = 0;
  std::array<std::vector<Access>, kThreads> logs_;
  std::vector<Slot> slots_;
  std::vector<uint8_t> reads_, writes_;
  char first_problem_[512] = "";
};

// Memory as the emulated phases see it: load_if / store_if as the GPU's view,
// each access checked (and recorded) first.
template <typename Element>
struct EmulatedMemory {
  using Bits = typename std::remove_const<Element>::type;
  Element* data;
  int64_t size;
  Space space;
  Context* context;

  Bits load_if(bool on, int64_t index) const {
    if (!context->access(space, false, on, index, size)) return Bits(0);
    return data[index];
  }
  void store_if(bool on, int64_t index, Bits value) const {
    if (context->access(space, true, on, index, size)) data[index] = value;
  }
};

// splitmix64: the numbers behind the thread orders.
class Random {
 public:
  explicit Random(uint64_t seed) : state_(seed) {}
  uint64_t operator()() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }

 private:
  uint64_t state_;
};

// Thread orders: a few shuffles of the block's threads, one picked per phase.
constexpr int kOrders = 16;

template <typename Bits>
void run_grid(const psa_mask::Plan& plan, const void* input, int64_t input_size, void* output,
              int64_t output_size, uint64_t seed, Context* context) {
  Random random(seed);
  std::vector<std::array<int, kThreads>> orders(kOrders);
  for (auto& order : orders) {
    for (int t = 0; t < kThreads; ++t) order[t] = t;
    for (int t = kThreads - 1; t > 0; --t) std::swap(order[t], order[random() % (t + 1)]);
  }
  std::vector<Bits> shared(static_cast<size_t>(std::max<int64_t>(plan.shared_elements, 1)));
  Bits poison;
  std::memset(&poison, 0xA5, sizeof(poison));
  const EmulatedMemory<const Bits> in{static_cast<const Bits*>(input), input_size, kInput,
                                     context};
  const EmulatedMemory<Bits> out{static_cast<Bits*>(output), output_size, kOutput, context};
  const EmulatedMemory<Bits> slab{shared.data(), plan.shared_elements, kShared, context};
  psa_mask::with_kernel<Bits>(plan, in, out, [&](const auto& kernel) {
    using Kernel = typename std::decay<decltype(kernel)>::type;
    for (int64_t block_y = 0; block_y < plan.grid_y; ++block_y) {
      for (int64_t block_x = 0; block_x < plan.grid_x; ++block_x) {
        const int64_t unit = block_y * plan.grid_x + block_x;
        if (unit >= plan.units) continue;  // as the kernel's first line
        const typename Kernel::Tile tile = kernel.tile(unit);
        std::fill(shared.begin(), shared.end(), poison);
        context->begin_unit(unit);
        for (int phase = 0; phase < Kernel::kPhases; ++phase) {
          context->begin_phase(phase);
          const auto& order = orders[random() % kOrders];
          for (int thread : order) {
            context->set_thread(thread);
            kernel.phase(phase, tile, thread % kTileColumns, thread / kTileColumns, slab);
          }
          context->end_phase();
        }
      }
    }
    return 0;
  });
}

thread_local char last_problem[512] = "";

}  // namespace

extern "C" {

int psa_emu_stats_size(void) { return static_cast<int>(sizeof(Stats)); }

// The first problem the last run on this thread saw ("" if none), or why it refused.
const char* psa_emu_problem(void) { return last_problem; }

// Forward (direction 0: x -> Y) or backward (1: grad_Y -> grad_x) of elements of
// element_bytes (2, 4 or 8), contiguous host buffers; the output is written as the
// kernels write it (pre-fill it to see what they leave). max_grid_x: the grid's
// widest first dimension (the launcher's is 2^31 - 1). Returns 0 after a run
// (its problems are in stats and psa_emu_problem), 1 for a bad argument.
int psa_emu_run(int element_bytes, int direction, int psa_type, int64_t num, int64_t feature_h,
                int64_t feature_w, int64_t mask_h, int64_t mask_w, const void* input,
                void* output, int64_t max_grid_x, uint64_t seed, int instrument, Stats* stats) {
  last_problem[0] = '\0';
  const bool sizes_ok = element_bytes == 2 || element_bytes == 4 || element_bytes == 8;
  if (!sizes_ok || (direction != 0 && direction != 1) || (psa_type != 0 && psa_type != 1) ||
      num < 0 || feature_h < 0 || feature_w < 0 || mask_h < 1 || mask_w < 1 || max_grid_x < 1 ||
      stats == nullptr) {
    std::snprintf(last_problem, sizeof(last_problem), "bad argument: element_bytes 2/4/8, "
                  "direction and psa_type 0/1, sizes >= 0, masks and max_grid_x >= 1, stats");
    return 1;
  }
  const psa_mask::Geometry g = psa_mask::make_geometry(num, feature_h, feature_w, mask_h, mask_w);
  const psa_mask::Plan plan =
      psa_mask::make_plan(g, psa_type, direction, element_bytes, max_grid_x);
  *stats = Stats{};
  stats->units = plan.units;
  stats->grid_x = plan.grid_x;
  stats->grid_y = plan.grid_y;
  stats->shared_bytes = plan.shared_bytes();
  stats->pitch = plan.pitch;
  stats->span = plan.span;
  if (!plan.fits_grid()) {
    std::snprintf(last_problem, sizeof(last_problem), "the grid needs %lld rows, more than "
                  "65535", static_cast<long long>(plan.grid_y));
    return 1;
  }
  const int64_t input_size = direction == 0 ? g.x_numel() : g.y_numel();
  const int64_t output_size = direction == 0 ? g.y_numel() : g.x_numel();
  Context context(instrument != 0, element_bytes, plan.shared_elements, input_size, output_size,
                  stats);
  if (element_bytes == 2) {
    run_grid<uint16_t>(plan, input, input_size, output, output_size, seed, &context);
  } else if (element_bytes == 4) {
    run_grid<uint32_t>(plan, input, input_size, output, output_size, seed, &context);
  } else {
    run_grid<uint64_t>(plan, input, input_size, output, output_size, seed, &context);
  }
  context.count_elements();
  std::snprintf(last_problem, sizeof(last_problem), "%s", context.first_problem());
  return 0;
}

}  // extern "C"
