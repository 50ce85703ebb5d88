# SPDX-License-Identifier: Apache-2.0
# ctest example_tiny_transformer_progress_rate: the progress line's tokens/s at the last step is the table's, within a
# factor of 2 (both time the same steps; the table's clock also takes the final barrier). With --untimed-steps 32 of
# 40 a rate that divides all 40 steps' tokens by the last 8 steps' time reads 5 times the table's.
#   cmake -DEXE=<tiny_transformer> -P progress_check.cmake
cmake_minimum_required(VERSION 3.25)
if(NOT DEFINED EXE)
  message(FATAL_ERROR "progress_check.cmake: -DEXE=... is required")
endif()
set(args --backend host --ranks 2 --steps 40 --untimed-steps 32 --eval 64)
execute_process(COMMAND "${EXE}" ${args} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
message("${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "tiny_transformer ${args} failed (${rc})")
endif()
# Not on a terminal, the progress is plain lines: "  Replicated x2: step 40/40  loss 3.9650  91234 tok/s".
if(NOT out MATCHES "step 40/40  loss [^ ]+  ([0-9]+) tok/s")
  message(FATAL_ERROR "no progress line for step 40/40")
endif()
set(progress "${CMAKE_MATCH_1}")
# The table's row: policy, ranks, time s, tokens/s, ...
if(NOT out MATCHES "\nReplicated +2 +[0-9.]+ +([0-9]+) ")
  message(FATAL_ERROR "no table row for Replicated at 2 ranks")
endif()
set(table "${CMAKE_MATCH_1}")
math(EXPR progress_x2 "${progress} * 2")
math(EXPR table_x2 "${table} * 2")
if(progress GREATER table_x2 OR table GREATER progress_x2)
  message(FATAL_ERROR "the last progress line says ${progress} tokens/s, the table ${table}: not within a factor of 2")
endif()
message(STATUS "the last progress line says ${progress} tokens/s, the table ${table}")
