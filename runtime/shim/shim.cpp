// The runtime's bridge to libtorch's dispatcher: binds an IR node (its tensor inputs and
// attributes, by schema argument name) to an ATen operator found by schema name, and calls it
// boxed, exactly as PyTorch's own op call does. Tensors cross the boundary as `at::Tensor*`,
// which is what tch's `C_tensor` is, so tch owns what this file returns.
//
// Every entry point catches C++ exceptions and returns them as a malloc'd message (NULL on
// success); the Rust side frees it with `rt_free_error`.

#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ScalarOps.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/library.h>

#include "codes.h"
#include "guarded.h"

#include <cmath>
#include <cstdint>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace {

using rt::error_message;
using rt::guarded;

// The tensor-argument names an IR node lists as absent (`weight`, `indices.0`).
constexpr const char* kAbsentTensorArgs = "absent_tensor_args";

// Attention on devices where libtorch has no kernel for the CPU flash-attention op a graph
// exported on the CPU holds: the same results from ATen's matmul, softmax and reductions, so a
// CPU-exported graph runs on a GPU. Forward returns (output, logsumexp over keys); backward
// recomputes the probabilities from the logsumexp, as the flash kernels do.
at::Tensor attention_scores(const at::Tensor& query, const at::Tensor& key, bool is_causal,
                            const std::optional<at::Tensor>& attn_mask, double scale) {
  auto scores = at::matmul(query, key.transpose(-2, -1)) * scale;
  if (is_causal) {
    const auto ones = at::ones({query.size(-2), key.size(-2)},
                               query.options().dtype(at::kBool));
    scores = scores.masked_fill(ones.tril().logical_not(), -INFINITY);
  }
  if (attn_mask.has_value() && attn_mask->defined()) {
    scores = attn_mask->scalar_type() == at::kBool
                 ? scores.masked_fill(attn_mask->logical_not(), -INFINITY)
                 : scores + *attn_mask;
  }
  return scores;
}

double attention_scale(const at::Tensor& query, std::optional<double> scale) {
  return scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(query.size(-1)));
}

std::tuple<at::Tensor, at::Tensor> attention_math(const at::Tensor& query, const at::Tensor& key,
                                                  const at::Tensor& value, double dropout_p,
                                                  bool is_causal,
                                                  const std::optional<at::Tensor>& attn_mask,
                                                  std::optional<double> scale) {
  TORCH_CHECK(dropout_p == 0.0, "the attention fallback runs without dropout only");
  const auto scores =
      attention_scores(query, key, is_causal, attn_mask, attention_scale(query, scale));
  auto logsumexp = at::logsumexp(scores, -1);
  auto probs = at::exp(scores - logsumexp.unsqueeze(-1));
  return {at::matmul(probs, value), logsumexp};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_math_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    double dropout_p, bool is_causal, const std::optional<at::Tensor>& attn_mask,
    std::optional<double> scale) {
  TORCH_CHECK(dropout_p == 0.0, "the attention fallback runs without dropout only");
  const double s = attention_scale(query, scale);
  const auto scores = attention_scores(query, key, is_causal, attn_mask, s);
  const auto probs = at::exp(scores - logsumexp.unsqueeze(-1));
  auto grad_value = at::matmul(probs.transpose(-2, -1), grad_out);
  const auto grad_probs = at::matmul(grad_out, value.transpose(-2, -1));
  const auto row = (grad_out * out).sum(-1, /*keepdim=*/true);
  const auto grad_scores = probs * (grad_probs - row);
  auto grad_query = at::matmul(grad_scores, key) * s;
  auto grad_key = at::matmul(grad_scores.transpose(-2, -1), query) * s;
  return {grad_query, grad_key, grad_value};
}

// PyTorch's own CPU Bernoulli sampler (what dropout draws its mask with): one double per
// element, in order, compared with `p`. PyTorch builds with MKL draw from MKL's generator
// instead on Intel CPUs, which gives other masks for the same seed; the exporter's reference
// draws this way on every CPU, and so does the runtime.
at::Tensor& portable_bernoulli_(at::Tensor& self, double p, std::optional<at::Generator> gen) {
  const auto draw = at::rand(self.sizes(), std::move(gen), self.options().dtype(at::kDouble));
  return self.copy_(draw.lt(p));
}

// Swallows warnings while it is installed.
struct QuietWarnings : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

}  // namespace

// The CPU-only flash-attention ops of CPU-exported graphs get CUDA kernels from the fallback.
TORCH_LIBRARY_IMPL(aten, CUDA, m) {
  m.impl("_scaled_dot_product_flash_attention_for_cpu", TORCH_FN(attention_math));
  m.impl("_scaled_dot_product_flash_attention_for_cpu_backward",
         TORCH_FN(attention_math_backward));
}

// The fallback under its own name, on every device, so it can be checked against the CPU
// kernel where there is no GPU.
TORCH_LIBRARY(recompute_runtime, m) {
  m.def(
      "attention_math(Tensor query, Tensor key, Tensor value, float dropout_p=0.0, "
      "bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None) -> "
      "(Tensor output, Tensor logsumexp)");
  m.def(
      "attention_math_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, "
      "Tensor out, Tensor logsumexp, float dropout_p, bool is_causal, *, "
      "Tensor? attn_mask=None, float? scale=None) -> "
      "(Tensor grad_query, Tensor grad_key, Tensor grad_value)");
}

TORCH_LIBRARY_IMPL(recompute_runtime, CompositeExplicitAutograd, m) {
  m.impl("attention_math", TORCH_FN(attention_math));
  m.impl("attention_math_backward", TORCH_FN(attention_math_backward));
}

extern "C" {

// One IR attribute, borrowed for the duration of a bind.
struct rt_attr {
  const char* name;
  rt_attr_kind kind;
  int64_t int_value;
  double float_value;
  const char* str_value;
  const int64_t* ints;
  const double* floats;
  const char* const* strs;
  size_t len;
};

void rt_free_error(char* message) {
  std::free(message);
}

}  // extern "C"

namespace {

// Device arguments of the graph's own device type (where it was exported) run on the run's
// device; others (a device-to-host copy on a GPU graph) stay.
struct DeviceMap {
  c10::DeviceType home;
  c10::Device run;

  c10::Device map(const c10::Device& device) const {
    return device.type() == home ? run : device;
  }
};

// Where one schema argument's value comes from at call time.
struct Slot {
  enum Kind { kConst, kTensor, kTensorList, kOptionalTensorList } kind;
  c10::IValue constant;                 // kConst
  size_t input = 0;                     // kTensor: the IR input position
  std::vector<std::optional<size_t>> items;  // lists: IR input per item, nullopt = None
};

// PyTorch's deterministic algorithms, on while at least one call that asks for them runs (a
// kernel that sums in no fixed order then sums in a fixed one). The setting is process-wide
// and ranks run as threads, so the calls in flight are counted: the first turns it on, the last
// restores what it found. Warn-only: an op without a deterministic kernel still runs.
class DeterministicSection {
 public:
  DeterministicSection() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (depth_++ == 0) {
      auto& context = at::globalContext();
      saved_ = context.deterministicAlgorithms();
      saved_warn_only_ = context.deterministicAlgorithmsWarnOnly();
      context.setDeterministicAlgorithms(true, /*warn_only=*/true);
    }
  }
  ~DeterministicSection() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (--depth_ == 0) {
      at::globalContext().setDeterministicAlgorithms(saved_, saved_warn_only_);
    }
  }
  DeterministicSection(const DeterministicSection&) = delete;
  DeterministicSection& operator=(const DeterministicSection&) = delete;

 private:
  static inline std::mutex mutex_;
  static inline int depth_ = 0;
  static inline bool saved_ = false;
  static inline bool saved_warn_only_ = false;
};

// An operator with every argument bound to a constant or to IR inputs.
struct BoundCall {
  c10::OperatorHandle op;
  std::vector<Slot> slots;
  size_t num_inputs = 0;
};

const rt_attr* find_attr(const rt_attr* attrs, size_t n, const std::string& name) {
  for (size_t i = 0; i < n; ++i) {
    if (name == attrs[i].name) {
      return &attrs[i];
    }
  }
  return nullptr;
}

std::string attr_kind_name(int32_t kind) {
  switch (kind) {
    case RT_ATTR_KIND_INT: return "an int";
    case RT_ATTR_KIND_FLOAT: return "a float";
    case RT_ATTR_KIND_STR: return "a string";
    case RT_ATTR_KIND_BOOL: return "a bool";
    case RT_ATTR_KIND_INTS: return "an int list";
    case RT_ATTR_KIND_FLOATS: return "a float list";
    case RT_ATTR_KIND_STRS: return "a string list";
    default: return "an unknown kind";
  }
}

[[noreturn]] void mismatch(const c10::Argument& arg, const rt_attr& attr) {
  throw std::runtime_error(
      "argument `" + arg.name() + "` has schema type " + arg.real_type()->str() +
      " but the IR attribute is " + attr_kind_name(attr.kind));
}

c10::ScalarType parse_dtype(const std::string& text) {
  static const std::unordered_map<std::string, c10::ScalarType> table = {
      {"float32", c10::kFloat},       {"float", c10::kFloat},
      {"float64", c10::kDouble},      {"double", c10::kDouble},
      {"float16", c10::kHalf},        {"half", c10::kHalf},
      {"bfloat16", c10::kBFloat16},   {"int64", c10::kLong},
      {"long", c10::kLong},           {"int32", c10::kInt},
      {"int", c10::kInt},             {"int16", c10::kShort},
      {"short", c10::kShort},         {"int8", c10::kChar},
      {"uint8", c10::kByte},          {"bool", c10::kBool},
      {"complex64", c10::kComplexFloat}, {"cfloat", c10::kComplexFloat},
      {"complex128", c10::kComplexDouble},
      {"float8_e4m3fn", c10::ScalarType::Float8_e4m3fn},
      {"float8_e5m2", c10::ScalarType::Float8_e5m2},
  };
  const std::string key = text.rfind("torch.", 0) == 0 ? text.substr(6) : text;
  auto it = table.find(key);
  if (it == table.end()) {
    throw std::runtime_error("unknown dtype `" + text + "`");
  }
  return it->second;
}

c10::Layout parse_layout(const std::string& text) {
  if (text == "torch.strided") return c10::kStrided;
  if (text == "torch.sparse_coo") return c10::kSparse;
  throw std::runtime_error("unsupported layout `" + text + "`");
}

c10::MemoryFormat parse_memory_format(const std::string& text) {
  if (text == "torch.contiguous_format") return c10::MemoryFormat::Contiguous;
  if (text == "torch.preserve_format") return c10::MemoryFormat::Preserve;
  if (text == "torch.channels_last") return c10::MemoryFormat::ChannelsLast;
  if (text == "torch.channels_last_3d") return c10::MemoryFormat::ChannelsLast3d;
  throw std::runtime_error("unknown memory format `" + text + "`");
}

std::vector<int64_t> int_list(const c10::Argument& arg, const rt_attr& attr) {
  if (attr.kind == RT_ATTR_KIND_INTS) {
    return std::vector<int64_t>(attr.ints, attr.ints + attr.len);
  }
  if (attr.kind == RT_ATTR_KIND_INT) {
    // `int[2] stride=1` accepts one int for every entry.
    return std::vector<int64_t>(arg.N().value_or(1), attr.int_value);
  }
  mismatch(arg, attr);
}

c10::Scalar scalar(const c10::Argument& arg, const rt_attr& attr) {
  switch (attr.kind) {
    case RT_ATTR_KIND_INT: return c10::Scalar(attr.int_value);
    case RT_ATTR_KIND_FLOAT: return c10::Scalar(attr.float_value);
    case RT_ATTR_KIND_BOOL: return c10::Scalar(static_cast<bool>(attr.int_value));
    default: mismatch(arg, attr);
  }
}

// The IValue an attribute gives a non-tensor argument of schema type `type`.
c10::IValue constant(const c10::Argument& arg, const c10::TypePtr& type, const rt_attr& attr,
                     const DeviceMap& devices) {
  const std::string text = attr.kind == RT_ATTR_KIND_STR ? attr.str_value : "";
  switch (type->kind()) {
    case c10::TypeKind::OptionalType:
      return constant(arg, type->castRaw<c10::OptionalType>()->getElementType(), attr, devices);
    case c10::TypeKind::IntType:
    case c10::TypeKind::SymIntType:
      if (attr.kind == RT_ATTR_KIND_INT) return c10::IValue(attr.int_value);
      if (attr.kind == RT_ATTR_KIND_BOOL) return c10::IValue(attr.int_value);
      mismatch(arg, attr);
    case c10::TypeKind::FloatType:
    case c10::TypeKind::SymFloatType:
      if (attr.kind == RT_ATTR_KIND_FLOAT) return c10::IValue(attr.float_value);
      if (attr.kind == RT_ATTR_KIND_INT) return c10::IValue(static_cast<double>(attr.int_value));
      mismatch(arg, attr);
    case c10::TypeKind::BoolType:
    case c10::TypeKind::SymBoolType:
      if (attr.kind == RT_ATTR_KIND_BOOL || attr.kind == RT_ATTR_KIND_INT) {
        return c10::IValue(attr.int_value != 0);
      }
      mismatch(arg, attr);
    case c10::TypeKind::NumberType:
      return c10::IValue(scalar(arg, attr));
    case c10::TypeKind::StringType:
      if (attr.kind == RT_ATTR_KIND_STR) return c10::IValue(text);
      mismatch(arg, attr);
    case c10::TypeKind::ScalarTypeType:
      if (attr.kind == RT_ATTR_KIND_STR) return c10::IValue(parse_dtype(text));
      if (attr.kind == RT_ATTR_KIND_INT) return c10::IValue(attr.int_value);
      mismatch(arg, attr);
    case c10::TypeKind::LayoutType:
      if (attr.kind == RT_ATTR_KIND_STR) return c10::IValue(parse_layout(text));
      mismatch(arg, attr);
    case c10::TypeKind::MemoryFormatType:
      if (attr.kind == RT_ATTR_KIND_STR) return c10::IValue(parse_memory_format(text));
      mismatch(arg, attr);
    case c10::TypeKind::DeviceObjType:
      if (attr.kind == RT_ATTR_KIND_STR) return c10::IValue(devices.map(c10::Device(text)));
      mismatch(arg, attr);
    case c10::TypeKind::ListType: {
      const auto element = type->castRaw<c10::ListType>()->getElementType();
      switch (element->kind()) {
        case c10::TypeKind::IntType:
        case c10::TypeKind::SymIntType:
          return c10::IValue(int_list(arg, attr));
        case c10::TypeKind::FloatType: {
          if (attr.kind == RT_ATTR_KIND_FLOATS) {
            return c10::IValue(std::vector<double>(attr.floats, attr.floats + attr.len));
          }
          if (attr.kind == RT_ATTR_KIND_INTS) {
            return c10::IValue(std::vector<double>(attr.ints, attr.ints + attr.len));
          }
          mismatch(arg, attr);
        }
        case c10::TypeKind::BoolType: {
          if (attr.kind != RT_ATTR_KIND_INTS) mismatch(arg, attr);
          c10::List<bool> bools;
          for (size_t i = 0; i < attr.len; ++i) bools.push_back(attr.ints[i] != 0);
          return c10::IValue(bools);
        }
        case c10::TypeKind::StringType: {
          if (attr.kind != RT_ATTR_KIND_STRS) mismatch(arg, attr);
          std::vector<std::string> strs(attr.strs, attr.strs + attr.len);
          return c10::IValue(strs);
        }
        default:
          break;
      }
      break;
    }
    default:
      break;
  }
  throw std::runtime_error(
      "argument `" + arg.name() + "` has schema type " + type->str() +
      ", which the runtime cannot build from an IR attribute");
}

// A Python number passed for a tensor argument (`add.Tensor(x, 1)`): a wrapped-number 0-dim
// CPU tensor, as PyTorch's argument parser makes it (it takes part in type promotion as a
// scalar, and kernels on any device accept it).
c10::IValue wrapped_number(const c10::Argument& arg, const rt_attr& attr) {
  return c10::IValue(at::native::wrapped_scalar_tensor(scalar(arg, attr)));
}

enum class TensorArg { kSingle, kList, kOptionalList, kNone };

TensorArg tensor_arg_kind(const c10::TypePtr& type) {
  auto t = type;
  if (t->kind() == c10::TypeKind::OptionalType) {
    t = t->castRaw<c10::OptionalType>()->getElementType();
  }
  if (t->kind() == c10::TypeKind::TensorType) return TensorArg::kSingle;
  if (t->kind() == c10::TypeKind::ListType) {
    auto element = t->castRaw<c10::ListType>()->getElementType();
    if (element->kind() == c10::TypeKind::TensorType) return TensorArg::kList;
    if (element->kind() == c10::TypeKind::OptionalType &&
        element->castRaw<c10::OptionalType>()->getElementType()->kind() ==
            c10::TypeKind::TensorType) {
      return TensorArg::kOptionalList;
    }
  }
  return TensorArg::kNone;
}

// The absent slots of every tensor argument: `weight` -> {-1}, `indices.0` -> {0}.
std::unordered_map<std::string, std::unordered_set<int64_t>> absent_args(const rt_attr* attr) {
  std::unordered_map<std::string, std::unordered_set<int64_t>> absent;
  if (attr == nullptr) return absent;
  if (attr->kind != RT_ATTR_KIND_STRS) {
    throw std::runtime_error(std::string("attribute `") + kAbsentTensorArgs +
                             "` must be a string list");
  }
  for (size_t i = 0; i < attr->len; ++i) {
    const std::string entry = attr->strs[i];
    const auto dot = entry.rfind('.');
    if (dot == std::string::npos) {
      absent[entry].insert(-1);
    } else {
      absent[entry.substr(0, dot)].insert(std::stoll(entry.substr(dot + 1)));
    }
  }
  return absent;
}

// Binds the schema's arguments, in order, to constants and to the node's `num_inputs` IR
// inputs (tensor arguments in schema order, lists flattened, absent ones skipped).
std::unique_ptr<BoundCall> bind(c10::OperatorHandle op, size_t num_inputs,
                                const rt_attr* attrs, size_t num_attrs,
                                const DeviceMap& devices) {
  const auto& args = op.schema().arguments();
  const auto absent = absent_args(find_attr(attrs, num_attrs, kAbsentTensorArgs));
  auto is_absent = [&](const std::string& name, int64_t slot) {
    auto it = absent.find(name);
    return it != absent.end() && it->second.count(slot) > 0;
  };
  // Tensor inputs the single-tensor arguments take, and how many list arguments share the rest.
  size_t singles = 0;
  size_t lists = 0;
  for (const auto& arg : args) {
    const auto kind = tensor_arg_kind(arg.real_type());
    if (kind == TensorArg::kSingle && !is_absent(arg.name(), -1) &&
        find_attr(attrs, num_attrs, arg.name()) == nullptr) {
      ++singles;
    } else if (kind == TensorArg::kList || kind == TensorArg::kOptionalList) {
      ++lists;
    }
  }
  if (singles > num_inputs) {
    throw std::runtime_error("the schema takes " + std::to_string(singles) +
                             " tensor arguments but the node has " +
                             std::to_string(num_inputs) + " inputs");
  }
  if (lists > 1) {
    throw std::runtime_error(
        "the schema has several tensor-list arguments and the IR does not say how many inputs "
        "belong to each");
  }
  const size_t list_items = num_inputs - singles;
  auto call = std::make_unique<BoundCall>(BoundCall{op, {}, num_inputs});
  size_t next = 0;
  for (const auto& arg : args) {
    const auto kind = tensor_arg_kind(arg.real_type());
    const rt_attr* attr = find_attr(attrs, num_attrs, arg.name());
    Slot slot{Slot::kConst, c10::IValue(), 0, {}};
    if (kind == TensorArg::kSingle) {
      if (is_absent(arg.name(), -1)) {
        slot.constant = c10::IValue();
      } else if (attr != nullptr) {
        slot.constant = wrapped_number(arg, *attr);
      } else {
        slot.kind = Slot::kTensor;
        slot.input = next++;
      }
    } else if (kind == TensorArg::kList || kind == TensorArg::kOptionalList) {
      slot.kind = kind == TensorArg::kList ? Slot::kTensorList : Slot::kOptionalTensorList;
      size_t taken = 0;
      for (int64_t i = 0; taken < list_items || is_absent(arg.name(), i); ++i) {
        if (is_absent(arg.name(), i)) {
          if (kind == TensorArg::kList) {
            throw std::runtime_error("list argument `" + arg.name() +
                                     "` cannot hold None");
          }
          slot.items.emplace_back(std::nullopt);
        } else {
          slot.items.emplace_back(next++);
          ++taken;
        }
      }
    } else if (attr != nullptr) {
      slot.constant = constant(arg, arg.real_type(), *attr, devices);
    } else if (arg.default_value().has_value()) {
      slot.constant = *arg.default_value();
    } else if (arg.real_type()->kind() == c10::TypeKind::OptionalType) {
      slot.constant = c10::IValue();
    } else {
      throw std::runtime_error("argument `" + arg.name() +
                               "` has no IR attribute and no default");
    }
    call->slots.push_back(std::move(slot));
  }
  if (next != num_inputs) {
    throw std::runtime_error("the schema's tensor arguments take " + std::to_string(next) +
                             " inputs but the node has " + std::to_string(num_inputs));
  }
  for (size_t i = 0; i < num_attrs; ++i) {
    const std::string name = attrs[i].name;
    if (name == kAbsentTensorArgs) continue;
    bool known = false;
    for (const auto& arg : args) known = known || arg.name() == name;
    if (!known) {
      throw std::runtime_error("attribute `" + name + "` names no argument of the schema");
    }
  }
  return call;
}

// Appends the defined tensors of one returned IValue to `out`, in order.
void collect_tensors(const c10::IValue& value, std::vector<at::Tensor>& out) {
  if (value.isTensor()) {
    if (value.toTensor().defined()) out.push_back(value.toTensor());
  } else if (value.isTensorList()) {
    for (const at::Tensor& t : value.toTensorVector()) {
      if (t.defined()) out.push_back(t);
    }
  } else if (value.isList()) {
    for (const c10::IValue& item : value.toListRef()) collect_tensors(item, out);
  } else if (value.isTuple()) {
    for (const c10::IValue& item : value.toTupleRef().elements()) collect_tensors(item, out);
  }
}

// The device of an `rt_device_type` (the CPU has no index; CUDA device `device_index`).
c10::Device device_of(int32_t device_type, int32_t device_index) {
  if (device_type == RT_DEVICE_TYPE_CPU) return c10::Device(c10::DeviceType::CPU);
  return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index));
}

}  // namespace

extern "C" {

// Finds `name` (`aten::mm`) with `overload` (`default` for the unnamed one) and binds it to an
// IR node; `*out` receives the bound call (free with `rt_call_free`). Device arguments of
// device type `home_type` run on (`run_type`, `run_index`); types are `rt_device_type`s.
// `*status` says what binding came to (`rt_bind_status`), the message why it failed.
char* rt_bind(const char* name, const char* overload, size_t num_inputs, const rt_attr* attrs,
              size_t num_attrs, int32_t home_type, int32_t run_type, int32_t run_index,
              void** out, int32_t* status) {
  *status = RT_BIND_STATUS_MISMATCH;
  return guarded([&] {
    const std::string overload_name = std::strcmp(overload, "default") == 0 ? "" : overload;
    const auto op = c10::Dispatcher::singleton().findSchema({name, overload_name});
    if (!op.has_value()) {
      *status = RT_BIND_STATUS_NO_SUCH_OPERATOR;
      throw std::runtime_error(std::string("libtorch has no operator ") + name + "." + overload);
    }
    const DeviceMap devices{device_of(home_type, 0).type(), device_of(run_type, run_index)};
    *out = bind(*op, num_inputs, attrs, num_attrs, devices).release();
    *status = RT_BIND_STATUS_OK;
  });
}

void rt_call_free(void* call) {
  delete static_cast<BoundCall*>(call);
}

// Whether the operator has a kernel that runs on the device type (`rt_device_type`): its own, a
// composite one, or a fallback.
int32_t rt_call_runs_on(void* call, int32_t device_type) {
  const auto& op = static_cast<BoundCall*>(call)->op;
  const auto key =
      device_type == RT_DEVICE_TYPE_CPU ? c10::DispatchKey::CPU : c10::DispatchKey::CUDA;
  return op.hasComputedKernelForDispatchKey(key) ? 1 : 0;
}

// The operator's schema, for messages (malloc'd; free with `rt_free_error`).
char* rt_call_schema(void* call) {
  std::ostringstream text;
  text << static_cast<BoundCall*>(call)->op.schema();
  return error_message(text.str());
}

// Runs a bound call on `inputs` (`num_inputs` must be what it was bound with), under PyTorch's
// deterministic algorithms when `deterministic` is not 0. Writes up to `capacity` returned
// tensors to `outputs` (each a new `at::Tensor*`) and their count to `*num_outputs`; more than
// `capacity` is an error.
char* rt_call_run(void* call_ptr, const at::Tensor* const* inputs, size_t num_inputs,
                  int32_t deterministic, at::Tensor** outputs, size_t capacity,
                  size_t* num_outputs) {
  return guarded([&] {
    const auto* call = static_cast<BoundCall*>(call_ptr);
    if (num_inputs != call->num_inputs) {
      throw std::runtime_error("called with " + std::to_string(num_inputs) +
                               " inputs, bound for " + std::to_string(call->num_inputs));
    }
    torch::jit::Stack stack;
    stack.reserve(call->slots.size());
    for (const auto& slot : call->slots) {
      switch (slot.kind) {
        case Slot::kConst:
          stack.push_back(slot.constant);
          break;
        case Slot::kTensor:
          stack.emplace_back(*inputs[slot.input]);
          break;
        case Slot::kTensorList: {
          c10::List<at::Tensor> list;
          for (const auto& item : slot.items) list.push_back(*inputs[*item]);
          stack.emplace_back(std::move(list));
          break;
        }
        case Slot::kOptionalTensorList: {
          c10::List<std::optional<at::Tensor>> list;
          for (const auto& item : slot.items) {
            list.push_back(item ? std::optional<at::Tensor>(*inputs[*item]) : std::nullopt);
          }
          stack.emplace_back(std::move(list));
          break;
        }
      }
    }
    {
      std::optional<DeterministicSection> section;
      if (deterministic != 0) section.emplace();
      call->op.callBoxed(stack);
    }
    std::vector<at::Tensor> results;
    for (const auto& value : stack) collect_tensors(value, results);
    if (results.size() > capacity) {
      throw std::runtime_error("the op returned " + std::to_string(results.size()) +
                               " tensors, the node has " + std::to_string(capacity) +
                               " outputs");
    }
    for (size_t i = 0; i < results.size(); ++i) {
      outputs[i] = new at::Tensor(std::move(results[i]));
    }
    *num_outputs = results.size();
  });
}

// The storage a tensor's data lives in (`*key` 0 when it has none) and its size in bytes.
void rt_storage(const at::Tensor* tensor, uintptr_t* key, size_t* nbytes) {
  if (!tensor->defined() || !tensor->has_storage()) {
    *key = 0;
    *nbytes = 0;
    return;
  }
  const auto& storage = tensor->storage();
  *key = reinterpret_cast<uintptr_t>(storage.unsafeGetStorageImpl());
  *nbytes = storage.nbytes();
}

// The default generator's state on a device (a new `at::Tensor*`).
char* rt_rng_get_state(int32_t device_type, int32_t device_index, at::Tensor** out) {
  return guarded([&] {
    auto gen = at::globalContext().defaultGenerator(device_of(device_type, device_index));
    std::lock_guard<std::mutex> lock(gen.mutex());
    *out = new at::Tensor(gen.get_state());
  });
}

// Restores the default generator's state on a device.
char* rt_rng_set_state(int32_t device_type, int32_t device_index, const at::Tensor* state) {
  return guarded([&] {
    auto gen = at::globalContext().defaultGenerator(device_of(device_type, device_index));
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(*state);
  });
}

// The state the default generator of a device has after seeding it with `seed`; the generator
// itself is left as it was.
char* rt_rng_seeded_state(int32_t device_type, int32_t device_index, uint64_t seed,
                          at::Tensor** out) {
  return guarded([&] {
    auto gen = at::globalContext().defaultGenerator(device_of(device_type, device_index));
    std::lock_guard<std::mutex> lock(gen.mutex());
    const at::Tensor before = gen.get_state();
    gen.set_current_seed(seed);
    *out = new at::Tensor(gen.get_state());
    gen.set_state(before);
  });
}

// Makes `device_index` the current CUDA device of the calling thread.
char* rt_cuda_set_device(int32_t device_index) {
  return guarded([&] {
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    impl.setDevice(device_of(RT_DEVICE_TYPE_CUDA, device_index));
  });
}

// The native handle (`cudaStream_t`) of the current CUDA stream of a device: the stream ATen
// launches its kernels on.
char* rt_cuda_current_stream(int32_t device_index, void** out) {
  return guarded([&] {
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    *out = impl.getStream(device_of(RT_DEVICE_TYPE_CUDA, device_index)).native_handle();
  });
}

// Waits until everything queued on the current stream of a CUDA device has run.
char* rt_cuda_synchronize(int32_t device_index) {
  return guarded([&] {
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    impl.getStream(device_of(RT_DEVICE_TYPE_CUDA, device_index)).synchronize();
  });
}

// Records an event on the current stream of a CUDA device (free with `rt_event_free`): it
// completes once everything queued before it has run.
char* rt_cuda_record_event(int32_t device_index, void** out) {
  return guarded([&] {
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    auto event = std::make_unique<c10::Event>(c10::DeviceType::CUDA);
    event->record(impl.getStream(device_of(RT_DEVICE_TYPE_CUDA, device_index)));
    *out = event.release();
  });
}

// Whether the work queued before the event has run (`rt_event_state`).
int32_t rt_event_query(void* event) {
  try {
    return static_cast<c10::Event*>(event)->query() ? RT_EVENT_STATE_DONE
                                                     : RT_EVENT_STATE_PENDING;
  } catch (...) {
    return RT_EVENT_STATE_FAILED;
  }
}

void rt_event_free(void* event) {
  delete static_cast<c10::Event*>(event);
}

// The caching allocator's peak of allocated bytes on a CUDA device since the last reset.
char* rt_cuda_peak_allocated(int32_t device_index, uint64_t* out) {
  return guarded([&] {
    const auto stats = at::accelerator::getDeviceStats(static_cast<c10::DeviceIndex>(device_index));
    const auto aggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    *out = static_cast<uint64_t>(stats.allocated_bytes[aggregate].peak);
  });
}

// Resets the caching allocator's peak statistics of a CUDA device.
char* rt_cuda_reset_peak(int32_t device_index) {
  return guarded([&] {
    at::accelerator::resetPeakStats(static_cast<c10::DeviceIndex>(device_index));
  });
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------
// Allocation budgets: a CPU allocator in front of libtorch's that refuses, on the thread that
// set a budget, any allocation past it. An op then fails before it allocates more than its
// declared tensors allow, instead of exhausting memory (an `arange` whose attributes disagree
// with its declared output, a size computed from data).

namespace {

// Bytes the running op of this thread may still allocate; negative: no budget.
thread_local int64_t allocation_budget = -1;
// The first allocation refused since it was last taken (0: none).
thread_local uint64_t refused_allocation = 0;

struct BudgetedCpuAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    if (allocation_budget >= 0) {
      if (n > static_cast<uint64_t>(allocation_budget)) {
        if (refused_allocation == 0) refused_allocation = n;
        TORCH_CHECK_WITH(OutOfMemoryError, false, "allocation of ", n,
                         " bytes refused: over the op's budget");
      }
      allocation_budget -= static_cast<int64_t>(n);
    }
    return inner->allocate(n);
  }

  c10::DeleterFnPtr raw_deleter() const override { return inner->raw_deleter(); }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    inner->copy_data(dest, src, count);
  }

  c10::Allocator* inner = nullptr;
};

// The process-wide changes a run makes to libtorch, in place while at least one holder (a
// prepared program) lives and undone when the last one goes, so code around the runtime sees
// libtorch as it was: the portable Bernoulli sampler in place of libtorch's CPU kernel, and the
// budgeted allocator in front of the CPU allocator. Ranks are threads, so holders are counted.
class KernelOverrides {
 public:
  static void acquire() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (holders_ == 0) install();
    ++holders_;
  }

  static void release() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (holders_ > 0 && --holders_ == 0) uninstall();
  }

 private:
  static void install() {
    // Replacing a kernel makes libtorch warn on stderr; that warning is swallowed.
    QuietWarnings quiet;
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                                    c10::DispatchKey::CPU, __FILE__, __LINE__);
    library->impl("bernoulli_.float", TORCH_FN(portable_bernoulli_));
    budgeted_.inner = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&budgeted_, /*priority=*/UINT8_MAX);
    bernoulli_ = std::move(library);
  }

  static void uninstall() {
    // Storages keep the allocator that made them (to resize), so the budgeted one lives on
    // and passes through to the allocator it found. (The CPU allocator's priority stays the
    // highest: libtorch lets nobody read or lower it.)
    c10::SetCPUAllocator(budgeted_.inner, /*priority=*/UINT8_MAX);
    // Dropping the library removes its kernel: libtorch's own runs again.
    bernoulli_.reset();
  }

  static inline std::mutex mutex_;
  static inline int holders_ = 0;
  static inline std::unique_ptr<torch::Library> bernoulli_;
  static inline BudgetedCpuAllocator budgeted_;
};

}  // namespace

extern "C" {

// Takes a hold on the run's process-wide changes to libtorch (made by the first hold).
char* rt_kernel_overrides_acquire() {
  return guarded([] { KernelOverrides::acquire(); });
}

// Gives a hold back (the last one undoes the changes).
char* rt_kernel_overrides_release() {
  return guarded([] { KernelOverrides::release(); });
}

// The CPU allocator libtorch allocates with now (its address, to compare).
uintptr_t rt_cpu_allocator() {
  return reinterpret_cast<uintptr_t>(c10::GetCPUAllocator());
}

// Whether PyTorch's deterministic algorithms are on.
int32_t rt_deterministic_algorithms() {
  return at::globalContext().deterministicAlgorithms() ? 1 : 0;
}

// The dispatcher's account of an operator (its kernels and where each was registered; free
// with `rt_free_error`).
char* rt_operator_state(const char* name, const char* overload, char** out) {
  return guarded([&] {
    const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
    *out = error_message(op.dumpState());
  });
}

// Sets the calling thread's budget in bytes (negative: none) and forgets any refusal.
void rt_set_allocation_budget(int64_t bytes) {
  allocation_budget = bytes;
  refused_allocation = 0;
}

// The first allocation refused on this thread since the budget was set (0: none).
uint64_t rt_refused_allocation() { return refused_allocation; }

}  // extern "C"
