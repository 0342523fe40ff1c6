// memory.cpp — exact byte counting of CPU tensor memory, for the benchmark's CPU meter.
//
// CountingAllocator wraps the allocator that c10::GetCPUAllocator() returns when the meter is
// installed and is set in its place with c10::SetCPUAllocator. Every CPU storage allocated from then
// on (at::empty and friends, outputs and temporaries of ATen ops and of our own C++ kernels,
// Inductor's buffers) passes through allocate(n), which counts n bytes — the size asked for, not
// the malloc block — and hands out a DataPtr whose deleter subtracts them again. It keeps current
// and peak bytes, and, while recording, a timeline of (time, current bytes) after each event.
//
// What is not counted: storages allocated before installation (they keep the old deleter and are
// freed uncounted), memory that does not go through c10's CPU allocator (pinned host memory from
// the CUDA host allocator, scratch that MKL / oneDNN / OpenMP allocate with their own malloc, Python
// objects), and tensors wrapping foreign memory (torch.from_numpy, from_blob).
#include "memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <chrono>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace ckpt_ext {

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The highest priority: c10 only lets an allocator of equal or higher priority replace the one in
// place, so installing (and later restoring) at this level cannot be silently ignored.
constexpr uint8_t kPriority = std::numeric_limits<uint8_t>::max();

class CountingAllocator final : public c10::Allocator {
 public:
  // The base allocator's DataPtr of every live counted block, keyed by the data pointer. The
  // handed-out DataPtr has data == context == that pointer and a plain function as deleter, so
  // raw_allocate / raw_deleter keep working (some ATen code frees through raw_deleter()).
  struct Block {
    c10::DataPtr base;
    size_t bytes;
  };

  c10::DataPtr allocate(size_t n) override {
    c10::Allocator* base = base_.load();
    c10::DataPtr p = base->allocate(n);
    void* data = p.get();
    if (data == nullptr) return p;  // zero-byte storages: nothing to count
    c10::Device device = p.device();
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks_.emplace(data, Block{std::move(p), n});
      current_ += static_cast<int64_t>(n);
      if (current_ > peak_) peak_ = current_;
      allocs_ += 1;
      allocated_total_ += static_cast<int64_t>(n);
      if (recording_) timeline_.push_back({now_ns(), current_});
    }
    return {data, data, &CountingAllocator::free_counted, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::free_counted; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static void free_counted(void* data) {
    CountingAllocator& self = instance();
    c10::DataPtr base;  // destroyed outside the lock: that is where the real free happens
    {
      std::lock_guard<std::mutex> lock(self.mu_);
      auto it = self.blocks_.find(data);
      TORCH_INTERNAL_ASSERT(it != self.blocks_.end(),
                            "ckpt_ext CPU meter: freeing a pointer it never handed out");
      self.current_ -= static_cast<int64_t>(it->second.bytes);
      self.frees_ += 1;
      base = std::move(it->second.base);
      self.blocks_.erase(it);
      if (self.recording_) self.timeline_.push_back({now_ns(), self.current_});
    }
  }

  // Never destroyed: storages counted by it may outlive any scope (and be freed at exit).
  static CountingAllocator& instance() {
    static auto* a = new CountingAllocator();
    return *a;
  }

  bool install() {
    std::lock_guard<std::mutex> lock(install_mu_);
    c10::Allocator* now = c10::GetCPUAllocator();
    if (now == this) return false;
    base_.store(now);
    c10::SetCPUAllocator(this, kPriority);
    TORCH_CHECK(c10::GetCPUAllocator() == this,
                "ckpt_ext CPU meter: c10::SetCPUAllocator did not take the counting allocator");
    return true;
  }

  bool uninstall() {
    std::lock_guard<std::mutex> lock(install_mu_);
    if (c10::GetCPUAllocator() != this) return false;
    // Storages counted so far keep our deleter, which keeps freeing through base_ and
    // subtracting: the figures stay true after uninstalling.
    c10::SetCPUAllocator(base_.load(), kPriority);
    return true;
  }

  bool installed() const { return c10::GetCPUAllocator() == this; }

  std::map<std::string, int64_t> stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return {{"current", current_},
            {"peak", peak_},
            {"allocs", allocs_},
            {"frees", frees_},
            {"allocated_total", allocated_total_},
            {"live_blocks", static_cast<int64_t>(blocks_.size())}};
  }

  int64_t reset_peak() {
    std::lock_guard<std::mutex> lock(mu_);
    peak_ = current_;
    return peak_;
  }

  // Starts (clearing) or stops the timeline. Starting puts one point at the current figure.
  void record(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    if (on) {
      timeline_.clear();
      timeline_.push_back({now_ns(), current_});
    }
    recording_ = on;
  }

  std::pair<std::vector<int64_t>, std::vector<int64_t>> timeline() {
    std::lock_guard<std::mutex> lock(mu_);
    std::pair<std::vector<int64_t>, std::vector<int64_t>> out;
    out.first.reserve(timeline_.size());
    out.second.reserve(timeline_.size());
    for (const auto& e : timeline_) {
      out.first.push_back(e.t_ns);
      out.second.push_back(e.bytes);
    }
    return out;
  }

 private:
  struct Event {
    int64_t t_ns;
    int64_t bytes;
  };

  CountingAllocator() = default;

  std::atomic<c10::Allocator*> base_{nullptr};
  std::mutex install_mu_;
  std::mutex mu_;  // guards everything below
  std::unordered_map<void*, Block> blocks_;
  int64_t current_ = 0, peak_ = 0, allocs_ = 0, frees_ = 0, allocated_total_ = 0;
  bool recording_ = false;
  std::vector<Event> timeline_;
};

}  // namespace

void bind_cpu_meter(pybind11::module_& m) {
  auto& a = CountingAllocator::instance();
  m.def("cpu_meter_install", [&a] { return a.install(); },
        "Install the counting CPU allocator; False if it already was.");
  m.def("cpu_meter_uninstall", [&a] { return a.uninstall(); },
        "Restore the wrapped CPU allocator; False if the meter was not installed.");
  m.def("cpu_meter_installed", [&a] { return a.installed(); });
  m.def("cpu_meter_stats", [&a] { return a.stats(); },
        "Counted bytes: current, peak, allocated_total; counts: allocs, frees, live_blocks.");
  m.def("cpu_meter_reset_peak", [&a] { return a.reset_peak(); },
        "Set peak to the current figure and return it.");
  m.def("cpu_meter_record", [&a](bool on) { a.record(on); }, pybind11::arg("on"),
        "Start (clearing) or stop the (time_ns, current_bytes) timeline.");
  m.def("cpu_meter_timeline", [&a] { return a.timeline(); },
        "The recorded timeline as two lists: steady-clock times in ns and current bytes.");
  m.def("cpu_meter_now_ns", &now_ns, "The meter's clock (steady_clock), in ns.");
}

}  // namespace ckpt_ext
