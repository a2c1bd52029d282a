/* Fallback shim for a libtorch without CUDA: every call fails with one clear message. */
#include <stdint.h>
#include <stddef.h>

struct WideMemoryStats { int64_t a, b, c, d, e; };
static const char* kMsg = "this build of wide links a libtorch without CUDA support; rebuild against a CUDA-enabled PyTorch (scripts/setup.sh installs one)";
const char* wide_shim_last_error(void) { return kMsg; }
int wide_cuda_device_count(int* out) { *out = 0; return 0; }
int wide_cuda_current_stream(int device, void** out) { (void)device; *out = NULL; return -1; }
int wide_cuda_synchronize(int device) { (void)device; return -1; }
int wide_cuda_set_device(int device) { (void)device; return -1; }
int wide_set_deterministic(int on) { (void)on; return -1; }
int wide_graph_new(int device, void** out) { (void)device; *out = NULL; return -1; }
int wide_graph_capture_begin(void* h) { (void)h; return -1; }
int wide_graph_capture_end(void* h) { (void)h; return -1; }
int wide_graph_replay(void* h) { (void)h; return -1; }
void wide_graph_free(void* h) { (void)h; }
int wide_memory_stats(int device, struct WideMemoryStats* out) { (void)device; (void)out; return -1; }
int wide_memory_reset_peak(int device) { (void)device; return -1; }
int wide_memory_empty_cache(void) { return -1; }
