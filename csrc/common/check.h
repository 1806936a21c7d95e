// Argument checks for the torch-facing op files (*.cpp).
//
// A failed check formats its message with vsnprintf and throws std::runtime_error
// (RuntimeError in Python).  TORCH_CHECK with values in the message (torch's iostream
// formatting) crashed the process inside this extension on the H100 machine's torch 2.11
// build, while this path raised cleanly: the op files use QF_CHECK.
#pragma once

#include <cstdarg>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace quantfuse {

[[noreturn]] inline void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline void fail(const char* fmt, ...) {
  char buf[768];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  throw std::runtime_error(std::string(buf));
}

}  // namespace quantfuse

#define QF_CHECK(cond, ...)                             \
  do {                                                  \
    if (!(cond)) ::quantfuse::fail(__VA_ARGS__);        \
  } while (0)
