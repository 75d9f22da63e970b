// How every entry point of the shim reports failure: C++ exceptions are caught and returned
// as a malloc'd message (NULL on success), which the Rust side frees with `rt_free_error`.

#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

namespace rt {

inline char* error_message(const std::string& message) {
  char* out = static_cast<char*>(std::malloc(message.size() + 1));
  if (out != nullptr) {
    std::memcpy(out, message.c_str(), message.size() + 1);
  }
  return out;
}

// The message of a caught exception.
inline std::string describe(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown C++ exception";
  }
}

template <typename F>
char* guarded(F&& body) {
  try {
    body();
    return nullptr;
  } catch (...) {
    return error_message(describe(std::current_exception()));
  }
}

}  // namespace rt
