# SPDX-License-Identifier: Apache-2.0
# Included by the cmake -P scripts that tests run (tests/consumer/run_consumer.cmake, tests/mpi/run_failure.cmake,
# tests/nccl_version/run.cmake): require_defined(<script> <variable>...) stops with a line naming the first variable
# not given as a non-empty -D<variable>=....
function(require_defined script)
  foreach(var IN LISTS ARGN)
    if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
      message(FATAL_ERROR "${script}: -D${var}=... is required")
    endif()
  endforeach()
endfunction()
