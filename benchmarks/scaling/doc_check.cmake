# SPDX-License-Identifier: Apache-2.0
# ctest benchmark_scaling_model_doc: docs/scaling.md shows what scaling_model prints. Every table row of a run with the
# defaults, and its "Inputs:" line, must be a line of the doc; so must every time-table row at 8, 16 and 64 GPUs of a
# run with one NIC per node (--busbw-inter 46: the doc's sensitivity table). A change to the model or its defaults that
# moves a figure fails here until the doc's tables are generated again.
#   cmake -DEXE=<scaling_model> -DDOC=<docs/scaling.md> -P doc_check.cmake
cmake_minimum_required(VERSION 3.25)
foreach(var IN ITEMS EXE DOC)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "doc_check.cmake: -D${var}=... is required")
  endif()
endforeach()
file(READ "${DOC}" doc)

# run(<out> <args>...): scaling_model's output, which must end with exit code 0.
function(run out)
  execute_process(COMMAND "${EXE}" ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE text ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "scaling_model ${ARGN} failed (${rc}):\n${err}")
  endif()
  set(${out} "${text}" PARENT_SCOPE)
endfunction()

set(missing "")
run(defaults)
string(REGEX MATCH "Inputs: [^\n]*" inputs "${defaults}")
string(FIND "${doc}" "\n${inputs}\n" at)
if(inputs STREQUAL "" OR at EQUAL -1)
  string(APPEND missing "\n  ${inputs}")
endif()
string(REGEX MATCHALL "\n\\| [0-9][^\n]*" rows "${defaults}")  # (table rows hold no semicolon: list items)
list(LENGTH rows count)
run(one_nic --busbw-inter 46)
string(REGEX MATCHALL "\n\\| (8|16|64) \\| [A-Za-z]+ \\| [0-9]+ \\|[^\n]*" nic_rows "${one_nic}")  # time rows only
list(LENGTH nic_rows nic_count)
foreach(row IN LISTS rows nic_rows)
  string(FIND "${doc}" "${row}\n" at)
  if(at EQUAL -1)
    string(APPEND missing "${row}")
  endif()
endforeach()
if(NOT missing STREQUAL "")
  message(FATAL_ERROR "docs/scaling.md lacks what scaling_model prints now (generate its tables again):${missing}")
endif()
message(STATUS "docs/scaling.md holds all ${count} rows of scaling_model's tables, and the ${nic_count} of one NIC")
