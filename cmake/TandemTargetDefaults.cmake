# SPDX-License-Identifier: Apache-2.0
#
# tandem_target_defaults(<target>): flags for the targets tandem builds itself (tests, examples, benchmarks,
# header checks). Never put on the INTERFACE target: consumers choose their own flags.
# - Warnings: -Wall -Wextra -Wpedantic (-Wshadow/-Wconversion are too noisy for index maths); nvcc gets -Wall for
#   the host side only, since -Wextra/-Wpedantic fire on nvcc's own generated code. Add
#   -DCMAKE_COMPILE_WARNING_AS_ERROR=ON to make them errors.
# - -fno-math-errno: sqrt in the host optimizer loops can only be vectorized when it need not set errno. tandem
#   never reads errno; docs/performance.md recommends the same flag to users of the host backend.
include_guard(GLOBAL)

function(tandem_target_defaults target)
  target_compile_options(
    ${target}
    PRIVATE "$<$<COMPILE_LANG_AND_ID:CXX,GNU,Clang,AppleClang>:-Wall;-Wextra;-Wpedantic;-fno-math-errno>"
            "$<$<COMPILE_LANG_AND_ID:CXX,MSVC>:/W4>" "$<$<COMPILE_LANG_AND_ID:CUDA,NVIDIA>:-Xcompiler=-Wall>")
endfunction()
