# SPDX-License-Identifier: Apache-2.0
# Runs a command line and fails unless its exit code and its output are as expected: the command-line tests of
# tiny_transformer (examples/CMakeLists.txt), scaling_model (benchmarks/scaling/CMakeLists.txt), tools/demo and
# tools/gpu-check (tests/CMakeLists.txt), which check that a bad argument is refused at once, in one line naming it.
#
#   cmake [-DEXPECT_RC=0] [-DREGEX=<regex>] [-DNOT_REGEX=<regex>] [-DABSENT=<path>[;<path>...]]
#         -P cli_check.cmake -- <program> <arguments>...
#
# REGEX must match, and NOT_REGEX must not, stdout and stderr together (say NOT_REGEX "training:" for a refusal that
# must come before any training). Each ABSENT path is removed before the run and must not exist after it: what a
# refused run must not leave behind.
cmake_minimum_required(VERSION 3.25)

if(NOT DEFINED EXPECT_RC)
  set(EXPECT_RC 0)
endif()

include("${CMAKE_CURRENT_LIST_DIR}/args_after_dashes.cmake")
set(command ${args_after_dashes})  # the program and its arguments
if(NOT command)
  message(FATAL_ERROR "cli_check.cmake: no command after --")
endif()

foreach(path IN LISTS ABSENT)
  file(REMOVE_RECURSE "${path}")
endforeach()
execute_process(COMMAND ${command} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(all "${out}${err}")
list(JOIN command " " shown)
message("${shown}\n${all}")
if(NOT rc STREQUAL EXPECT_RC)
  message(FATAL_ERROR "exited with ${rc}; expected ${EXPECT_RC}")
endif()
if(DEFINED REGEX AND NOT all MATCHES "${REGEX}")
  message(FATAL_ERROR "the output does not match '${REGEX}'")
endif()
if(DEFINED NOT_REGEX AND all MATCHES "${NOT_REGEX}")
  message(FATAL_ERROR "the output matches '${NOT_REGEX}' (it must not)")
endif()
foreach(path IN LISTS ABSENT)
  if(EXISTS "${path}")
    message(FATAL_ERROR "${path} exists after the run; it must not")
  endif()
endforeach()
