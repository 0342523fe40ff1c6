// memory.cpp — exact byte counting of CPU tensor memory, for the benchmark's CPU meter.
//
// CountingAllocator wraps the allocator that c10::GetCPUAllocator() returns when the meter is
// installed and is set in its place with c10::SetCPUAllocator. Every CPU storage allocated from then
// on passes through allocate(n), which counts n bytes (the size asked for, not the malloc block)
// and hands out a DataPtr whose deleter subtracts them again. It keeps current and peak bytes,
// and, while recording, a timeline of (time, current bytes) after each event. What is not
// counted: docs/design.md, "The CPU memory meter".
#include "memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <pybind11/stl.h>

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

// c10 keeps one priority per device type: SetCPUAllocator(a, p) takes only if p is at least the
// priority in place, and then leaves p in place. Installing at the maximum priority would make
// that sticky: after uninstalling, nobody could replace c10's allocator below it again. So the
// meter installs at the lowest priority that takes (the one in place, 0 unless someone raised it)
// and restores the old allocator at that same priority, leaving c10's priority unchanged.
constexpr int kMaxPriority = std::numeric_limits<uint8_t>::max();

// Passes everything through to the allocator in place; only used to ask c10 whether a new
// allocator at priority 0 would take (allocator_replaceable_at_priority_0, a test hook).
class ProbeAllocator final : public c10::Allocator {
 public:
  explicit ProbeAllocator(c10::Allocator* to) : to_(to) {}
  c10::DataPtr allocate(size_t n) override { return to_->allocate(n); }
  c10::DeleterFnPtr raw_deleter() const override { return to_->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    to_->copy_data(dest, src, count);
  }

 private:
  c10::Allocator* to_;
};

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
      note_event();
    }
    return {data, data, &CountingAllocator::free_counted, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::free_counted; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // The deleter of every counted DataPtr. It runs inside destructors, so it must not throw: an
  // exception here would be std::terminate. A pointer it never handed out (memory raw_allocate'd
  // from the wrapped allocator before the meter was installed, and handed back through
  // GetCPUAllocator()->raw_deallocate() after) goes to the wrapped allocator's own deleter and is
  // counted in foreign_frees, not in the bytes.
  static void free_counted(void* data) noexcept {
    CountingAllocator& self = instance();
    c10::DataPtr base;  // destroyed outside the lock: that is where the real free happens
    c10::DeleterFnPtr foreign = nullptr;
    {
      std::lock_guard<std::mutex> lock(self.mu_);
      auto it = self.blocks_.find(data);
      if (it == self.blocks_.end()) {
        self.foreign_frees_ += 1;
        c10::Allocator* wrapped = self.base_.load();
        foreign = wrapped != nullptr ? wrapped->raw_deleter() : nullptr;
      } else {
        self.current_ -= static_cast<int64_t>(it->second.bytes);
        self.frees_ += 1;
        base = std::move(it->second.base);
        self.blocks_.erase(it);
        self.note_event();
      }
    }
    if (foreign != nullptr) foreign(data);
    // (No deleter at all: leaking the block is the only safe thing left.)
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
    for (int p = 0; p <= kMaxPriority && c10::GetCPUAllocator() != this; ++p) {
      c10::SetCPUAllocator(this, static_cast<uint8_t>(p));
      priority_ = p;
    }
    TORCH_CHECK(c10::GetCPUAllocator() == this,
                "ckpt_ext CPU meter: c10::SetCPUAllocator did not take the counting allocator");
    return true;
  }

  bool uninstall() {
    std::lock_guard<std::mutex> lock(install_mu_);
    if (c10::GetCPUAllocator() != this) return false;
    // Storages counted so far keep our deleter, which keeps freeing through base_ and
    // subtracting: the figures stay true after uninstalling.
    c10::SetCPUAllocator(base_.load(), static_cast<uint8_t>(priority_));
    return true;
  }

  // The priority the meter was installed at last (-1: never installed).
  int priority() const { return priority_; }

  bool installed() const { return c10::GetCPUAllocator() == this; }

  std::map<std::string, int64_t> stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return {{"current", current_},
            {"peak", peak_},
            {"allocs", allocs_},
            {"frees", frees_},
            {"allocated_total", allocated_total_},
            {"live_blocks", static_cast<int64_t>(blocks_.size())},
            {"foreign_frees", foreign_frees_},
            {"timeline_dropped", timeline_dropped_}};
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

  // After a change of current_, under mu_. Called from the deleter too, so a failed push_back
  // (out of memory) is counted, not thrown.
  void note_event() noexcept {
    if (!recording_) return;
    try {
      timeline_.push_back({now_ns(), current_});
    } catch (...) {
      timeline_dropped_ += 1;
    }
  }

  std::atomic<c10::Allocator*> base_{nullptr};
  std::mutex install_mu_;
  std::mutex mu_;  // guards everything below
  std::unordered_map<void*, Block> blocks_;
  int64_t current_ = 0, peak_ = 0, allocs_ = 0, frees_ = 0, allocated_total_ = 0;
  int64_t foreign_frees_ = 0, timeline_dropped_ = 0;
  int priority_ = -1;  // guarded by install_mu_
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
  m.def("cpu_meter_priority", [&a] { return a.priority(); },
        "The c10 allocator priority the meter was installed at last (-1: never).");
  // Test hooks (tests/test_meter.py).
  m.def("_cpu_allocator_replaceable", [] {
    // Whether an allocator set at priority 0 would take now: set a pass-through probe at 0, see
    // whether it is in place, and put back what was there (at 0, which takes whenever the probe
    // did). Nothing is allocated through the probe that it does not pass on unchanged.
    c10::Allocator* now = c10::GetCPUAllocator();
    auto* probe = new ProbeAllocator(now);  // leaked on purpose (a few bytes): c10 never frees one
    c10::SetCPUAllocator(probe, 0);
    const bool took = c10::GetCPUAllocator() == probe;
    if (took) c10::SetCPUAllocator(now, 0);
    return took;
  }, "Test hook: would c10 take a new CPU allocator at priority 0 now?");
  m.def("_cpu_meter_free_foreign", [](int64_t nbytes) {
    // Memory from the allocator in place before the meter, handed back through the deleter of
    // the allocator in place now (the meter, when installed), from a DataPtr's destructor, as
    // code that wraps raw memory with allocator->raw_deleter() does: the deleter meets a pointer
    // it never handed out, inside a noexcept destructor.
    void* p = c10::GetDefaultCPUAllocator()->raw_allocate(static_cast<size_t>(nbytes));
    c10::DataPtr owner(p, p, c10::GetCPUAllocator()->raw_deleter(), c10::Device(c10::kCPU));
  }, pybind11::arg("nbytes"),
        "Test hook: free, through c10's current CPU allocator's deleter, a block it did not allocate.");
}

}  // namespace ckpt_ext
