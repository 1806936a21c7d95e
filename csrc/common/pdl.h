// Whether the decode kernels launch with programmatic dependent launch (common/pdl.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/device_attribute.h"

namespace quantfuse {

// Whether QUANTFUSE_PDL allows PDL: unset, empty or "1" yes, "0" no (surrounding spaces ignored);
// another value throws std::invalid_argument naming the variable, as compile_backend/kernels/pdl.py's
// check raises ValueError, so that eager calls and compiled ones read it alike.
inline bool pdl_allowed_by_env() {
  const char* v = std::getenv("QUANTFUSE_PDL");
  if (v == nullptr) return true;
  std::string s(v);
  const size_t b = s.find_first_not_of(" \t\n\r");
  s = b == std::string::npos ? std::string() : s.substr(b, s.find_last_not_of(" \t\n\r") - b + 1);
  if (s.empty() || s == "1") return true;
  if (s == "0") return false;
  throw std::invalid_argument("QUANTFUSE_PDL='" + std::string(v) +
                              "'; expected '0' (off) or '1' (on where the GPU has it, the default)");
}

// Whether kernels launch with PDL on `device` by default: where it has it (device_attribute.h), unless
// QUANTFUSE_PDL=0.  The variable is read at every launch (a getenv, well under a microsecond of the host's
// launch cost; a captured CUDA graph keeps what its capture chose), so that one process may compare both.
inline bool pdl_default(int device) { return pdl_allowed_by_env() && pdl_supported(device); }

// What a decode kernel launched with PDL does before griddepcontrol.wait, from QUANTFUSE_PDL_PREFETCH
// (read at every launch, as QUANTFUSE_PDL, so that one process may measure each).  kPdlEarlyNone (unset
// or "0", the default): nothing; its loads follow the wait.  The two others are for measurement only:
// kPdlEarlyRegisters ("regs") loads its first batch of weights, and their groups' scales and zeros, into
// registers (the AWQ kernel; the others do nothing early); kPdlEarlyL2 ("l2") asks its whole K range
// into L2.  "regs" reads weights into registers while the kernel before may still run, which is wrong
// where that kernel writes them (a repacked layout made on a cache miss right before the GEMM); "l2"
// only asks lines into L2, the point of coherence, so later loads still see such writes.  Neither pays:
// "regs" measured within 0.5% of nothing in the 32-layer decode step, "l2" slower than launching without
// PDL at all (0.89-0.97x: the requests compete with the previous kernel's traffic, and weights larger
// than the L2 are partly evicted before the main loop reads them).
enum PdlEarly { kPdlEarlyNone = 0, kPdlEarlyL2 = 1, kPdlEarlyRegisters = 2 };
inline int pdl_early() {
  const char* v = std::getenv("QUANTFUSE_PDL_PREFETCH");
  if (v == nullptr || std::strcmp(v, "0") == 0) return kPdlEarlyNone;
  return std::strcmp(v, "regs") == 0 ? kPdlEarlyRegisters : kPdlEarlyL2;
}
inline bool pdl_prefetch() { return pdl_early() == kPdlEarlyL2; }

// An op's `pdl` argument: -1 the default above, 0 off, 1 on where the GPU has it.
inline bool pdl_for(int64_t pdl, int device) {
  return pdl < 0 ? pdl_default(device) : (pdl != 0 && pdl_supported(device));
}

}  // namespace quantfuse
