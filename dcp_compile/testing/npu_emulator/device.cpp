// An emulated Ascend device for tests: PyTorch's PrivateUse1 dispatch key (renamed "npu" in
// Python), backed by host memory.
//
// - Memory: an allocator whose data pointers carry the npu device; the bytes live in host memory.
// - Device guard: device indices per thread, one stream per device (work runs when issued), and
//   events that are always complete.
// - Kernels: allocation, views (which must alias), copies to and from the host, resizing and
//   scalar reads are registered here. Every other aten op falls back to its CPU kernel, run on
//   host views of the same bytes (no copy in; a new result is copied out once, a result that
//   aliases an argument stays an npu view of it). An op of another namespace that has no npu
//   kernel fails as it does on a device without one: "Could not run '...' with arguments from
//   the 'npu' backend".
// - Op coverage: an aten op that torch_npu runs on the host (no NPU kernel, or a kernel whose CPU
//   fallback takes these arguments: op_coverage.py decides, asked once per op, and per call
//   for ops whose kernels fall back conditionally) is counted as off the device and as a host
//   sync; so is an op whose NPU kernel synchronises the stream to learn its output's shape
//   (nonzero, masked_select, ...: op_coverage.SYNCS); a blocking device-to-host copy, a scalar
//   read and a host-to-device copy that torch_npu synchronises (every one but a non-blocking
//   copy from pinned memory) count as host syncs too. Every host-to-device byte is counted.
// - Hooks: pinned host memory (a set of pinned blocks, so that a capture can tell pageable
//   copies from pinned ones).

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/_local_scalar_dense_native.h>
#include <ATen/ops/as_strided_cpu_dispatch.h>
#include <ATen/ops/copy_native.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/set_cpu_dispatch.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/library.h>

#include <atomic>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace dcp_npu_emulator {

constexpr c10::DeviceType kNPU = c10::DeviceType::PrivateUse1;
std::atomic<int> device_count{8};
thread_local c10::DeviceIndex current_device = 0;

void free_host(void* data) { c10::free_cpu(data); }

struct DeviceAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* data = nbytes ? c10::alloc_cpu(nbytes) : nullptr;
    return {data, data, &free_host, c10::Device(kNPU, current_device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_host; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

DeviceAllocator device_allocator;
REGISTER_ALLOCATOR(kNPU, &device_allocator);

// Pinned host memory: host memory the emulator remembers handing out, so that is_pinned() and
// a graph capture can tell it from pageable memory.
std::mutex pinned_mutex;
std::unordered_set<const void*> pinned_blocks;

void free_pinned(void* data) {
  {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    pinned_blocks.erase(data);
  }
  c10::free_cpu(data);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* data = nbytes ? c10::alloc_cpu(nbytes) : nullptr;
    if (data) {
      std::lock_guard<std::mutex> lock(pinned_mutex);
      pinned_blocks.insert(data);
    }
    return {data, data, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

PinnedAllocator pinned_allocator;

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return device_count.load(); }
  void setCurrentDevice(c10::DeviceIndex device) const override { current_device = device; }
  c10::DeviceIndex getCurrentDevice() const override { return current_device; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    auto previous = current_device;
    current_device = device;
    return previous;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override { return exchangeDevice(device); }
  bool isPinnedPtr(const void* data) const override {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    return pinned_blocks.count(data) > 0;
  }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
  at::Device getDeviceFromPtr(void*) const override { return at::Device(kNPU, current_device); }
  // Random numbers come from the host generator (the CPU kernels draw them).
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override { return at::detail::getDefaultCPUGenerator(); }
  at::Generator getNewGenerator(c10::DeviceIndex) const override { return at::detail::createCPUGenerator(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    auto old = storage.unsafeGetStorageImpl();
    auto data = device_allocator.allocate(newsize);
    if (old->data() && newsize) {
      std::memcpy(data.get(), old->data(), std::min(newsize, old->nbytes()));
    }
    old->set_data_ptr_noswap(std::move(data));
    old->set_nbytes(newsize);
  }
};

struct RegisterHooks {
  RegisterHooks() { at::RegisterPrivateUse1HooksInterface(new Hooks()); }
};
RegisterHooks register_hooks;

struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kNPU; }
  c10::Device exchangeDevice(c10::Device device) const override {
    auto previous = getDevice();
    current_device = device.index();
    return previous;
  }
  c10::Device getDevice() const override { return c10::Device(kNPU, current_device); }
  void setDevice(c10::Device device) const override { current_device = device.index(); }
  void uncheckedSetDevice(c10::Device device) const noexcept override { current_device = device.index(); }
  c10::Stream getStream(c10::Device device) const override { return c10::Stream(c10::Stream::DEFAULT, device); }
  c10::Stream getNewStream(c10::Device device, int) const override { return c10::Stream(c10::Stream::DEFAULT, device); }
  c10::Stream exchangeStream(c10::Stream stream) const override { return stream; }
  c10::DeviceIndex deviceCount() const noexcept override { return device_count.load(); }
  // Work runs when it is issued: every event is complete, every stream idle.
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

void no_delete(void*) {}

at::Tensor as_host(const at::Tensor& tensor) {
  // The same bytes, seen as a CPU tensor (the device's memory is host memory): a CPU storage over
  // the whole device storage, at the same offset, so that a result aliasing it can be mapped
  // back. It is resizable: a CPU kernel that resizes its out= argument moves it to new host
  // memory, which the fallback then copies back into the (resized) device tensor.
  void* data = tensor.storage().mutable_data();
  c10::Storage storage(c10::Storage::use_byte_size_t(), tensor.storage().nbytes(),
                       c10::DataPtr(data, data, &no_delete, c10::Device(c10::DeviceType::CPU)),
                       c10::GetCPUAllocator(), /*resizable=*/true);
  at::Tensor host = at::detail::empty_cpu({0}, tensor.scalar_type());
  at::cpu::set_(host, storage, tensor.storage_offset(), tensor.sizes(), tensor.strides());
  return host;
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "the npu emulator takes strided tensors only");
  const c10::DeviceGuard guard(c10::device_or_default(device));
  return at::detail::empty_generic(size, &device_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> pin_memory) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "the npu emulator takes strided tensors only");
  const c10::DeviceGuard guard(c10::device_or_default(device));
  return at::detail::empty_strided_generic(size, stride, &device_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                      std::optional<c10::SymInt> storage_offset) {
  return at::cpu::as_strided_symint(self, size, stride, std::move(storage_offset));
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

const at::Tensor& resize(const at::Tensor& self, c10::SymIntArrayRef size, std::optional<at::MemoryFormat> format) {
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), format);
}

// Host syncs: blocking reads of the device by the host, host waits, and calls of ops torch_npu
// runs on the host or synchronises for.
std::atomic<int64_t> host_sync_count{0};
std::atomic<int64_t> h2d_byte_count{0};
std::mutex off_device_mutex;
std::map<std::string, int64_t> off_device_calls;
std::map<std::string, int64_t> syncing_calls;
// Set while an NPU graph replays: its recorded copies are graph tasks that the host does not wait
// for (a capture refused any copy that would sync).
thread_local bool replaying = false;

bool is_pinned_storage(const at::Tensor& tensor) {
  std::lock_guard<std::mutex> lock(pinned_mutex);
  return pinned_blocks.count(tensor.storage().data()) > 0;
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  // One side at least is an npu tensor; both are host memory.
  if (!self.is_cpu() && dst.is_cpu() && !non_blocking && !replaying) {
    ++host_sync_count;
  }
  if (self.is_cpu() && !dst.is_cpu()) {
    h2d_byte_count += dst.numel() * self.element_size();
    // torch_npu synchronises the stream for a blocking copy (CopyKernel.cpp:141-142) and after a
    // non-blocking one from memory it did not pin (CachingHostAllocator.cpp:1405-1410, 1452-1457).
    if (!replaying && !(non_blocking && is_pinned_storage(self))) {
      ++host_sync_count;
    }
  }
  at::Tensor source = self.is_cpu() ? self : as_host(self);
  at::Tensor target = dst.is_cpu() ? dst : as_host(dst);
  at::native::copy_(target, source, non_blocking);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  ++host_sync_count;
  return at::native::_local_scalar_dense_cpu(as_host(self));
}

at::Tensor& set_source_storage(at::Tensor& self, at::Storage source) { return at::native::set_(self, source); }

at::Tensor& set_source_storage_offset(at::Tensor& self, at::Storage source, c10::SymInt offset,
                                      c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::cpu::set__symint(self, source, offset, size, stride);
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) { return at::native::set_tensor_(self, source); }

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("unfold", at::native::unfold);
  m.impl("view_as_real", at::native::view_as_real);
  m.impl("view_as_complex", at::native::view_as_complex);
  m.impl("resize_", resize);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Storage_storage_offset", set_source_storage_offset);
  m.impl("set_.source_Tensor", set_source_tensor);
}

bool on_device(const c10::IValue& value) { return value.isTensor() && value.toTensor().defined() && value.toTensor().device().type() == kNPU; }

// A CPU kernel's result, back on the device: the argument itself where the schema says the
// result is that argument (in-place and out= ops); a view of an argument where the result shares
// its storage (a view op without a kernel here); else a new npu tensor holding a copy.
c10::IValue to_device(const c10::IValue& result, const std::vector<std::pair<at::Tensor, at::Tensor>>& arguments,
                      const c10::Device& device) {
  if (!result.isTensor() || !result.toTensor().defined() || !result.toTensor().is_cpu()) {
    return result;
  }
  const at::Tensor& host = result.toTensor();
  for (const auto& [npu, host_view] : arguments) {
    if (host.storage().data() == host_view.storage().data()) {
      return at::cpu::as_strided(npu, host.sizes(), host.strides(), host.storage_offset());
    }
  }
  const c10::DeviceGuard guard(device);
  at::Tensor out = at::detail::empty_strided_generic(host.sizes(), host.strides(), &device_allocator,
                                                     c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                     host.scalar_type());
  at::Tensor out_host = as_host(out);
  at::native::copy_(out_host, host, false);
  return out;
}

// Verdicts of op_coverage.py, per operator: 0 on the device, 1 off it, 2 decided per call (as 0, 1
// or 3), 3 on the device with a stream synchronisation.
constexpr int8_t kOffDevice = 1;
constexpr int8_t kConditional = 2;
constexpr int8_t kSyncs = 3;
std::mutex verdict_mutex;
std::unordered_map<const c10::FunctionSchema*, int8_t> verdicts;

int8_t call_verdict(const c10::FunctionSchema& schema, const torch::jit::Stack& stack) {
  int8_t verdict = -1;
  {
    std::lock_guard<std::mutex> lock(verdict_mutex);
    auto found = verdicts.find(&schema);
    if (found != verdicts.end()) {
      verdict = found->second;
    }
  }
  if (verdict == 0 || verdict == kOffDevice || verdict == kSyncs) {
    return verdict;
  }
  const std::string name = schema.name().substr(6);  // past "aten::"
  pybind11::gil_scoped_acquire gil;  // the lock is not held here: Python may wait on another thread
  auto coverage = pybind11::module_::import("dcp_compile.testing.npu_emulator.op_coverage");
  if (verdict == -1) {
    verdict = coverage.attr("verdict")(name, schema.overload_name()).cast<int8_t>();
    std::lock_guard<std::mutex> lock(verdict_mutex);
    verdicts[&schema] = verdict;
  }
  if (verdict != kConditional) {
    return verdict;
  }
  pybind11::list arguments;
  for (const auto& value : torch::jit::last(stack, schema.arguments().size())) {
    arguments.append(torch::jit::toPyObject(value));
  }
  return coverage.attr("decide")(name, schema.overload_name(), arguments).cast<int8_t>();
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& name = schema.name();
  TORCH_CHECK_NOT_IMPLEMENTED(
      name.rfind("aten::", 0) == 0, "Could not run '", name,
      "' with arguments from the 'npu' backend. This could be because the operator doesn't exist for this backend "
      "(the dcp_compile npu emulator runs aten ops on the host, and other ops only where they have an npu kernel)");
  const int8_t where = replaying ? 0 : call_verdict(schema, *stack);
  if (where == kOffDevice || where == kSyncs) {
    ++host_sync_count;
    std::lock_guard<std::mutex> lock(off_device_mutex);
    ++(where == kOffDevice ? off_device_calls : syncing_calls)[c10::toString(schema.operator_name())];
  }
  const auto num_arguments = schema.arguments().size();
  auto arguments = torch::jit::last(stack, num_arguments);
  const auto first = stack->size() - num_arguments;
  std::vector<c10::IValue> originals(arguments.begin(), arguments.end());
  std::vector<std::pair<at::Tensor, at::Tensor>> views;
  c10::Device device(kNPU, current_device);
  for (size_t i = 0; i < num_arguments; ++i) {
    auto& value = (*stack)[first + i];
    if (on_device(value)) {
      device = value.toTensor().device();
      auto host_view = as_host(value.toTensor());
      views.emplace_back(value.toTensor(), host_view);
      value = host_view;
    } else if (value.isTensorList()) {
      auto list = value.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        at::Tensor element = list.get(j);
        if (element.defined() && element.device().type() == kNPU) {
          auto host_view = as_host(element);
          views.emplace_back(element, host_view);
          list.set(j, host_view);
        }
      }
      value = list;
    } else if (value.isOptionalTensorList()) {
      auto list = value.toOptionalTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        std::optional<at::Tensor> element = list.get(j);
        if (element.has_value() && element->defined() && element->device().type() == kNPU) {
          auto host_view = as_host(*element);
          views.emplace_back(*element, host_view);
          list.set(j, host_view);
        }
      }
      value = list;
    } else if (value.isDevice() && value.toDevice().type() == kNPU) {
      value = c10::Device(c10::DeviceType::CPU);
    }
  }
  std::vector<const void*> before;
  for (const auto& [npu, host_view] : views) {
    before.push_back(host_view.storage().data());
  }
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  for (size_t i = 0; i < views.size(); ++i) {  // an out= argument the kernel resized: back to the device
    const auto& [npu, host_view] = views[i];
    if (host_view.storage().data() != before[i]) {
      at::native::resize_(npu, host_view.sizes(), std::nullopt);
      auto target = as_host(npu);
      at::native::copy_(target, host_view, false);
    } else if (host_view.sizes() != npu.sizes() || host_view.strides() != npu.strides() ||
               host_view.storage_offset() != npu.storage_offset()) {
      // Resized within its storage (an empty out= argument given its shape, say): same bytes,
      // new shape.
      npu.unsafeGetTensorImpl()->set_sizes_and_strides(host_view.sizes(), host_view.strides(),
                                                       host_view.storage_offset());
    }
  }
  const auto& returns = schema.returns();
  const auto first_result = stack->size() - returns.size();
  for (size_t i = 0; i < returns.size(); ++i) {
    auto& result = (*stack)[first_result + i];
    const auto* alias = returns[i].alias_info();
    if (alias != nullptr && alias->isWrite()) {  // an in-place or out= op returns its argument
      for (size_t a = 0; a < num_arguments; ++a) {
        const auto* argument_alias = schema.arguments()[a].alias_info();
        if (argument_alias != nullptr && argument_alias->beforeSets() == alias->beforeSets()) {
          result = originals[a];
        }
      }
      continue;
    }
    if (result.isTensorList()) {
      auto list = result.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        list.set(j, to_device(list.get(j), views, device).toTensor());
      }
      result = list;
    } else {
      result = to_device(result, views, device);
    }
  }
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }

// Ops torch_npu gives kernels of their own where torch has a composite one (scatter_reduce's
// functional and in-place forms, whose NPU kernels fall back to the CPU on some arguments): the
// fallback above, registered as their npu kernel, so that it sees them rather than the out= op
// torch's composite would call.
void register_device_kernels(std::vector<std::string> names) {
  static std::mutex mutex;
  static std::vector<std::unique_ptr<torch::Library>> libraries;
  std::lock_guard<std::mutex> lock(mutex);
  auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1,
                                                  __FILE__, __LINE__);
  for (const auto& name : names) {
    library->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
  libraries.push_back(std::move(library));
}

at::Tensor host_view(const at::Tensor& tensor) {
  TORCH_CHECK(tensor.device().type() == kNPU, "host_view takes an npu tensor, got ", tensor.device());
  return as_host(tensor);
}

void set_device_count(int64_t count) { device_count.store(static_cast<int>(count)); }

void set_device(int64_t index) {
  TORCH_CHECK(0 <= index && index < device_count.load(), "npu device ", index, " is out of range (",
              device_count.load(), " devices)");
  current_device = static_cast<c10::DeviceIndex>(index);
}

int64_t get_device() { return current_device; }

bool is_pinned_host(const at::Tensor& tensor) { return is_pinned_storage(tensor); }

int64_t host_syncs() { return host_sync_count.load(); }

void count_host_sync() { ++host_sync_count; }

int64_t h2d_bytes() { return h2d_byte_count.load(); }

bool set_replaying(bool value) {
  bool previous = replaying;
  replaying = value;
  return previous;
}

std::tuple<std::vector<std::string>, std::vector<int64_t>> op_calls(bool off_device) {
  std::lock_guard<std::mutex> lock(off_device_mutex);
  std::vector<std::string> names;
  std::vector<int64_t> calls;
  for (const auto& [name, count] : off_device ? off_device_calls : syncing_calls) {
    names.push_back(name);
    calls.push_back(count);
  }
  return {names, calls};
}

std::tuple<std::vector<std::string>, std::vector<int64_t>> ops_off_device() { return op_calls(true); }

std::tuple<std::vector<std::string>, std::vector<int64_t>> syncing_ops() { return op_calls(false); }

void reset_host_syncs() {
  host_sync_count.store(0);
  h2d_byte_count.store(0);
  std::lock_guard<std::mutex> lock(off_device_mutex);
  off_device_calls.clear();
  syncing_calls.clear();
}

TORCH_LIBRARY(dcp_npu_emulator, m) {
  m.def("host_view(Tensor(a) self) -> Tensor(a)");
  m.impl("host_view", c10::DispatchKey::PrivateUse1, TORCH_FN(host_view));
  m.def("set_device_count(int count) -> ()", TORCH_FN(set_device_count));
  m.def("set_device(int index) -> ()", TORCH_FN(set_device));
  m.def("get_device() -> int", TORCH_FN(get_device));
  m.def("register_device_kernels(str[] names) -> ()", TORCH_FN(register_device_kernels));
  m.def("host_syncs() -> int", TORCH_FN(host_syncs));
  m.def("ops_off_device() -> (str[], int[])", TORCH_FN(ops_off_device));
  m.def("syncing_ops() -> (str[], int[])", TORCH_FN(syncing_ops));
  m.def("count_host_sync() -> ()", TORCH_FN(count_host_sync));
  m.def("h2d_bytes() -> int", TORCH_FN(h2d_bytes));
  m.def("set_replaying(bool value) -> bool", TORCH_FN(set_replaying));
  m.def("reset_host_syncs() -> ()", TORCH_FN(reset_host_syncs));
  m.def("is_pinned_host(Tensor self) -> bool");
  m.impl("is_pinned_host", c10::DispatchKey::CPU, TORCH_FN(is_pinned_host));
}

}  // namespace dcp_npu_emulator
