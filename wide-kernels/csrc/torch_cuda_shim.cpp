// The few libtorch CUDA facilities that tch does not expose, behind a C ABI:
// the current CUDA stream (our kernels launch on it), CUDA graph capture and replay,
// and the caching allocator's memory statistics.
//
// Every function returns 0 on success and -1 on failure; the message of the failure is then
// available from wide_shim_last_error() on the same thread.
#include <ATen/Context.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <map>
#include <mutex>

#include <cstdint>
#include <exception>
#include <optional>
#include <string>

namespace {
thread_local std::string g_last_error;

template <typename F>
int guarded(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    g_last_error = e.what();
  } catch (...) {
    g_last_error = "unknown C++ exception";
  }
  return -1;
}

// Sets a device for the scope and restores the previous one. (CUDAGuard would pull inline
// runtime-API calls into this object and with them a link dependency on libcudart.)
struct DeviceScope {
  c10::DeviceIndex previous;
  explicit DeviceScope(c10::DeviceIndex d) : previous(c10::cuda::current_device()) {
    if (d != previous) c10::cuda::set_device(d);
  }
  ~DeviceScope() {
    try {
      c10::cuda::set_device(previous);
    } catch (...) {
    }
  }
};

struct Graph {
  at::cuda::CUDAGraph graph;
  c10::DeviceIndex device;
  std::optional<c10::cuda::CUDAStream> previous_stream;
  explicit Graph(c10::DeviceIndex d) : graph(), device(d) {}
  void restore_stream() {
    if (previous_stream) {
      c10::cuda::setCurrentCUDAStream(*previous_stream);
      previous_stream.reset();
    }
  }
};
}  // namespace

extern "C" {

struct WideMemoryStats {
  int64_t allocated_current;
  int64_t allocated_peak;
  int64_t reserved_current;
  int64_t reserved_peak;
  int64_t num_ooms;
};

const char* wide_shim_last_error() { return g_last_error.c_str(); }

int wide_cuda_device_count(int* out) {
  return guarded([&] { *out = static_cast<int>(c10::cuda::device_count()); });
}

int wide_cuda_current_stream(int device, void** out) {
  return guarded([&] {
    auto stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
    *out = reinterpret_cast<void*>(stream.stream());
  });
}

int wide_cuda_synchronize(int device) {
  return guarded([&] {
    DeviceScope scope(static_cast<c10::DeviceIndex>(device));
    c10::cuda::device_synchronize();
  });
}

int wide_set_deterministic(int on) {
  return guarded([&] {
    at::globalContext().setDeterministicAlgorithms(on != 0, /*warn_only=*/true);
    at::globalContext().setDeterministicCuDNN(on != 0);
    at::globalContext().setBenchmarkCuDNN(false);
  });
}

int wide_cuda_set_device(int device) {
  return guarded([&] { c10::cuda::set_device(static_cast<c10::DeviceIndex>(device)); });
}

int wide_graph_new(int device, void** out) {
  return guarded([&] { *out = new Graph(static_cast<c10::DeviceIndex>(device)); });
}

// Capture runs on a side stream (capture on the legacy default stream is not allowed); the
// work already queued is finished first so that the capture sees a quiet device.
int wide_graph_capture_begin(void* handle) {
  return guarded([&] {
    auto* g = static_cast<Graph*>(handle);
    c10::cuda::set_device(g->device);
    c10::cuda::device_synchronize();
    // One side stream per device for every capture: libraries cache per-stream state (cuBLAS
    // keeps a workspace per stream), so a new pool stream per graph would leave one workspace
    // behind for each of up to 32 pool streams.
    static std::mutex mu;
    static std::map<int, c10::cuda::CUDAStream> sides;
    std::lock_guard<std::mutex> lock(mu);
    auto it = sides.find(g->device);
    if (it == sides.end()) it = sides.emplace(g->device, c10::cuda::getStreamFromPool(false, g->device)).first;
    auto side = it->second;
    g->previous_stream = c10::cuda::getCurrentCUDAStream(g->device);
    c10::cuda::setCurrentCUDAStream(side);
    try {
      // Thread-local capture mode: another thread's unsafe CUDA calls (a caching-allocator
      // cudaMalloc, say) neither fail nor invalidate this capture, as they do in the global mode
      // (the default). libtorch's CUDA generator still refuses other threads' draws during a
      // capture, so the GPU tests also take the device one at a time.
      g->graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    } catch (...) {
      g->restore_stream();
      throw;
    }
  });
}

int wide_graph_capture_end(void* handle) {
  auto* g = static_cast<Graph*>(handle);
  int rc = guarded([&] { g->graph.capture_end(); });
  g->restore_stream();
  return rc;
}

int wide_graph_replay(void* handle) {
  return guarded([&] {
    auto* g = static_cast<Graph*>(handle);
    DeviceScope scope(g->device);
    g->graph.replay();
  });
}

void wide_graph_free(void* handle) {
  auto* g = static_cast<Graph*>(handle);
  try {
    g->restore_stream();
    delete g;
  } catch (...) {
  }
}

int wide_memory_stats(int device, WideMemoryStats* out) {
  return guarded([&] {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
    const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out->allocated_current = stats.allocated_bytes[agg].current;
    out->allocated_peak = stats.allocated_bytes[agg].peak;
    out->reserved_current = stats.reserved_bytes[agg].current;
    out->reserved_peak = stats.reserved_bytes[agg].peak;
    out->num_ooms = stats.num_ooms;
  });
}

int wide_memory_reset_peak(int device) {
  return guarded([&] {
    c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
  });
}

int wide_memory_empty_cache() {
  return guarded([&] { c10::cuda::CUDACachingAllocator::emptyCache(); });
}

}  // extern "C"
