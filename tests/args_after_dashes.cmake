# SPDX-License-Identifier: Apache-2.0
# Included by the cmake -P scripts that run a command line in a test (tests/cli_check.cmake,
# examples/tandem_memory_check.cmake): sets `args_after_dashes` to the script's arguments after "--".
set(args_after_dashes)
set(_after_dashes OFF)
math(EXPR _last "${CMAKE_ARGC} - 1")
foreach(_i RANGE ${_last})
  if(_after_dashes)
    list(APPEND args_after_dashes "${CMAKE_ARGV${_i}}")
  elseif("${CMAKE_ARGV${_i}}" STREQUAL "--")
    set(_after_dashes ON)
  endif()
endforeach()
