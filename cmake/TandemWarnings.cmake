# SPDX-License-Identifier: Apache-2.0
#
# tandem_set_warnings(<target>): the warning flags for targets tandem builds itself (tests, examples, benchmarks,
# header checks). Never put on the INTERFACE target: consumers choose their own warnings.
# -Wshadow/-Wconversion are left out on purpose (too noisy for index maths); nvcc gets -Wall for the host side only,
# since -Wextra/-Wpedantic fire on nvcc's own generated code. Add -DCMAKE_COMPILE_WARNING_AS_ERROR=ON to make
# them errors.
include_guard(GLOBAL)

function(tandem_set_warnings target)
  target_compile_options(
    ${target}
    PRIVATE "$<$<COMPILE_LANG_AND_ID:CXX,GNU,Clang,AppleClang>:-Wall;-Wextra;-Wpedantic>"
            "$<$<COMPILE_LANG_AND_ID:CXX,MSVC>:/W4>" "$<$<COMPILE_LANG_AND_ID:CUDA,NVIDIA>:-Xcompiler=-Wall>")
endfunction()
