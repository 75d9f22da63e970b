// libtorch's c10d pieces for ranks in separate processes: the key-value store PyTorch's
// launchers rendezvous through (`c10d::TCPStore`, a client of the launcher's store or the
// store rank 0 hosts, under a `c10d::PrefixStore`), and the gloo process group PyTorch runs
// CPU collectives with (`c10d::ProcessGroupGloo`, compiled into libtorch_cpu; its headers
// include gloo's, vendored under `runtime/vendor/gloo`).
//
// Collectives are started here and return a `c10d::Work` the Rust side polls: it decides
// how long to wait and whom to blame, through its own control channel. Every entry point
// catches C++ exceptions and returns them as a malloc'd message (NULL on success).

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "guarded.h"

namespace {

using rt::guarded;

using StorePtr = c10::intrusive_ptr<c10d::Store>;
using GroupPtr = c10::intrusive_ptr<c10d::ProcessGroupGloo>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

StorePtr& store_of(void* store) { return *static_cast<StorePtr*>(store); }

GroupPtr& group_of(void* group) { return *static_cast<GroupPtr*>(group); }

std::chrono::milliseconds millis(int64_t ms) { return std::chrono::milliseconds(ms); }

// The reductions the Rust side asks for, numbered as c10d numbers them.
c10d::ReduceOp reduce_op(int32_t code) {
  switch (code) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::PRODUCT:
    case c10d::ReduceOp::MIN:
    case c10d::ReduceOp::MAX:
      return c10d::ReduceOp(static_cast<c10d::ReduceOp::RedOpType>(code));
    default:
      throw std::runtime_error("gloo has no reduction numbered " + std::to_string(code));
  }
}

// The device gloo connects the ranks through: the interface `GLOO_SOCKET_IFNAME` names (the
// first of a comma-separated list), as PyTorch picks it, else this host's name or loopback.
std::shared_ptr<::gloo::transport::Device> gloo_device() {
  const char* names = std::getenv("GLOO_SOCKET_IFNAME");
  if (names != nullptr && names[0] != '\0') {
    std::string first(names);
    first = first.substr(0, first.find(','));
    return c10d::ProcessGroupGloo::createDeviceForInterface(first);
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

void* boxed(WorkPtr work) { return new WorkPtr(std::move(work)); }

}  // namespace

extern "C" {

// A store at `host:port` for `workers` processes: the server when `server` is set, a client
// otherwise. As in PyTorch's env:// rendezvous, every process counts itself in and the server
// waits until all `workers` have. Every operation gives up after `timeout_ms`. Keys live under
// `prefix` when it is not empty.
char* rt_store_open(const char* host, uint16_t port, int32_t server, int64_t workers,
                    int64_t timeout_ms, const char* prefix, void** out) {
  return guarded([&] {
    c10d::TCPStoreOptions options;
    options.port = port;
    options.isServer = server != 0;
    options.numWorkers = static_cast<std::size_t>(workers);
    options.waitWorkers = true;
    options.timeout = millis(timeout_ms);
    options.multiTenant = true;
    StorePtr store = c10::make_intrusive<c10d::TCPStore>(std::string(host), options);
    if (prefix[0] != '\0') {
      store = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), store);
    }
    *out = new StorePtr(std::move(store));
  });
}

void rt_store_free(void* store) { delete static_cast<StorePtr*>(store); }

char* rt_store_set(void* store, const char* key, const uint8_t* value, size_t len) {
  return guarded([&] {
    store_of(store)->set(std::string(key), std::vector<uint8_t>(value, value + len));
  });
}

// The value of `key`, once some rank has set it (within the store's timeout); malloc'd, free
// it with `rt_free_error`.
char* rt_store_get(void* store, const char* key, char** value, size_t* len) {
  return guarded([&] {
    std::vector<uint8_t> bytes = store_of(store)->get(std::string(key));
    *value = static_cast<char*>(std::malloc(bytes.size() + 1));
    if (*value == nullptr) {
      throw std::bad_alloc();
    }
    std::memcpy(*value, bytes.data(), bytes.size());
    (*value)[bytes.size()] = '\0';
    *len = bytes.size();
  });
}

// Rank `rank` of a gloo group of `world`, meeting the others through `store` under `prefix`;
// collectives fail after `timeout_ms`.
char* rt_gloo_new(void* store, const char* prefix, int32_t rank, int32_t world,
                  int64_t timeout_ms, void** out) {
  return guarded([&] {
    auto options = c10d::ProcessGroupGloo::Options::create(millis(timeout_ms));
    options->devices.push_back(gloo_device());
    auto scoped = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), store_of(store));
    GroupPtr group = c10::make_intrusive<c10d::ProcessGroupGloo>(scoped, rank, world, options);
    *out = new GroupPtr(std::move(group));
  });
}

// Destroys the group: waits for its queued collectives, so only once they all completed.
void rt_gloo_free(void* group) { delete static_cast<GroupPtr*>(group); }

// `tensor` reduced in place over the ranks.
char* rt_gloo_allreduce(void* group, at::Tensor* tensor, int32_t op, void** work) {
  return guarded([&] {
    std::vector<at::Tensor> tensors{*tensor};
    c10d::AllreduceOptions options;
    options.reduceOp = reduce_op(op);
    *work = boxed(group_of(group)->allreduce(tensors, options));
  });
}

// Every rank's `input`, concatenated in rank order into `output`.
char* rt_gloo_allgather(void* group, at::Tensor* output, at::Tensor* input, void** work) {
  return guarded([&] { *work = boxed(group_of(group)->_allgather_base(*output, *input)); });
}

// Rows of `input` to each rank (`input_splits`), rows from each rank into `output`
// (`output_splits`); `ranks` entries each.
char* rt_gloo_alltoall(void* group, at::Tensor* output, at::Tensor* input,
                       const int64_t* output_splits, const int64_t* input_splits, size_t ranks,
                       void** work) {
  return guarded([&] {
    std::vector<int64_t> outs(output_splits, output_splits + ranks);
    std::vector<int64_t> ins(input_splits, input_splits + ranks);
    *work = boxed(group_of(group)->alltoall_base(*output, *input, outs, ins));
  });
}

// 1 once the collective completed, 0 while it runs, -1 when it failed (`error` then holds
// why: malloc'd, free it with `rt_free_error`).
int32_t rt_work_poll(void* work, char** error) {
  *error = nullptr;
  try {
    auto& handle = *static_cast<WorkPtr*>(work);
    if (!handle->isCompleted()) {
      return 0;
    }
    if (handle->isSuccess()) {
      return 1;
    }
    *error = rt::error_message(rt::describe(handle->exception()));
  } catch (...) {
    *error = rt::error_message(rt::describe(std::current_exception()));
  }
  return -1;
}

void rt_work_free(void* work) { delete static_cast<WorkPtr*>(work); }

}  // extern "C"
