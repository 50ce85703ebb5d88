# SPDX-License-Identifier: Apache-2.0
#
# tandem_target_defaults(<target>): flags for the targets tandem builds itself (tests, examples, benchmarks,
# header checks). Never put on the INTERFACE target: consumers choose their own flags.
# - Warnings: -Wall -Wextra -Wpedantic (-Wshadow/-Wconversion are too noisy for index maths); nvcc gets -Wall for
#   the host side only, since -Wextra/-Wpedantic fire on nvcc's own generated code. Add
#   -DCMAKE_COMPILE_WARNING_AS_ERROR=ON to make them errors.
# - -fno-math-errno: sqrt in the host optimizer loops can only be vectorized when it need not set errno. tandem
#   never reads errno; docs/performance.md recommends the same flag to users of the host backend.
# - -ffp-contract=off (host code; nvcc's host compiler too): the rounding rule (kernels/detail/rounding.hpp,
#   docs/design.md "Rounding rule"). Kernel bodies round every product on its own (__fmul_rn on the device), so host
#   and device give the same bits only if the host compiler does not fuse multiplies into adds either; GCC's C++
#   default is -ffp-contract=fast in every -std mode (ISO modes turn it off for C only), which fuses wherever the
#   target has FMA (-march=native, -mfma, any aarch64). On x86-64 without FMA the flag changes no instruction. Not
#   for MSVC, which does not contract under its default /fp:precise.
include_guard(GLOBAL)

function(tandem_target_defaults target)
  target_compile_options(
    ${target}
    PRIVATE "$<$<COMPILE_LANG_AND_ID:CXX,GNU,Clang,AppleClang>:-Wall;-Wextra;-Wpedantic;-fno-math-errno>"
            "$<$<COMPILE_LANG_AND_ID:CXX,GNU,Clang,AppleClang>:-ffp-contract=off>"
            "$<$<COMPILE_LANG_AND_ID:CXX,MSVC>:/W4>" "$<$<COMPILE_LANG_AND_ID:CUDA,NVIDIA>:-Xcompiler=-Wall>"
            "$<$<AND:$<COMPILE_LANG_AND_ID:CUDA,NVIDIA>,$<NOT:$<PLATFORM_ID:Windows>>>:-Xcompiler=-ffp-contract=off>")
endfunction()
