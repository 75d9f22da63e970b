// The codes the shim and the Rust runtime exchange, defined once: shim.cpp includes this file
// and build.rs writes the Rust enums from it (`ffi::AttrKind`, `ffi::BindStatus`, ...), so neither
// side spells a code as a bare number.
//
// build.rs reads every `enum rt_NAME { RT_NAME_VARIANT = VALUE, ... };` below: one variant a
// line, the prefix the enum's name in capitals, a comment line before a variant its doc.

#pragma once

#include <cstdint>

// The kind of an IR attribute value (`ir::AttrValue`), one per variant.
enum rt_attr_kind : int32_t {
  // One integer.
  RT_ATTR_KIND_INT = 0,
  // One float.
  RT_ATTR_KIND_FLOAT = 1,
  // One string.
  RT_ATTR_KIND_STR = 2,
  // One bool, carried as the integer 0 or 1.
  RT_ATTR_KIND_BOOL = 3,
  // A list of integers (bool lists as 0 / 1).
  RT_ATTR_KIND_INTS = 4,
  // A list of floats.
  RT_ATTR_KIND_FLOATS = 5,
  // A list of strings.
  RT_ATTR_KIND_STRS = 6,
};

// What binding an IR node to an operator came to (`rt_bind`).
enum rt_bind_status : int32_t {
  // Bound.
  RT_BIND_STATUS_OK = 0,
  // libtorch has no operator of that name and overload.
  RT_BIND_STATUS_NO_SUCH_OPERATOR = 1,
  // The operator exists but the node does not fit its schema (the message says how).
  RT_BIND_STATUS_MISMATCH = 2,
};

// A device type, as the entry points that take one number it (a CUDA device with its index).
enum rt_device_type : int32_t {
  // The CPU (which has no index).
  RT_DEVICE_TYPE_CPU = 0,
  // A CUDA device.
  RT_DEVICE_TYPE_CUDA = 1,
};

// What a CUDA event says of the work queued before it (`rt_event_query`).
enum rt_event_state : int32_t {
  // Still running.
  RT_EVENT_STATE_PENDING = 0,
  // Done.
  RT_EVENT_STATE_DONE = 1,
  // The device reported an error.
  RT_EVENT_STATE_FAILED = -1,
};
