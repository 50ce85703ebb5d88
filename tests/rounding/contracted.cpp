// SPDX-License-Identifier: Apache-2.0
// tandem's kernel bodies compiled as nvcc compiles them for the device, on the host: tests/CMakeLists.txt builds this
// file with -ffp-contract=fast (and -mfma on x86-64), so every raw `c + a * b` becomes one FMA, as nvcc's -fmad=true
// makes it, while a product written detail::mul_rn(a, b) stays rounded on its own, as __fmul_rn does on the device:
// TANDEM_DETAIL_ROUNDED_PRODUCT passes it through an empty asm statement, which no optimizer sees through.
// tests/test_rounding.cpp compares the bits these bodies produce with the ordinary build's.
//
// Namespace tandem is renamed here (tandem_contracted), so that the inline functions of this build, which differ from
// the ordinary build's, are other functions: the linker never picks one build's copy for the other. (No system header
// uses the name, so the renaming reaches only tandem's code.)

namespace rounding_opaque {
// The value (a float, a double, or a host vector of four floats) leaves the optimizer's sight: it is stored, the asm
// may have changed it, and it is loaded again.
template <class T>
inline T rounded(T x) {
  __asm__ volatile("" : "+m"(x));
  return x;
}
}  // namespace rounding_opaque

#define TANDEM_DETAIL_ROUNDED_PRODUCT(x) ::rounding_opaque::rounded(x)
#define tandem tandem_contracted

#include "bodies_impl.hpp"

const rounding::Bodies& rounding::contracted_bodies() { return this_build; }
