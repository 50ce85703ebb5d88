# SPDX-License-Identifier: Apache-2.0
#
# Runs tests/mpi/failure.cpp under mpiexec and checks how the job fails (ctest mpi_failure_<mode>):
#   cmake -DMPIEXEC=<mpiexec> -DNUMPROC_FLAG=<-n> -DFLAGS=<flag;...> -DNP=<ranks> -DEXE=<mpi_failure> -DMODE=<mode>
#         -DBOUND=<seconds> [-DMARGIN_MS=<ms>] [-DDIR=<scratch directory> -DTOOL=<tandem_checkpoint>]
#         -P run_failure.cmake
# The last rank fails at step 5 of a 400-step run (MODE kill: SIGKILL; throw: an exception destroys its Mpi; abort:
# an exception whose text Mpi::abort passes on), or in the middle of writing its file of the second save into DIR
# (kill_saving: SIGXFSZ). Passes when every other rank reports a tandem error that names the failed rank (a
# tandem::peer_error; for abort, carrying its text) no later than the ranks' MpiOptions::liveness_interval plus
# MARGIN_MS (default 800 ms, for a loaded 2-core machine; the defect this guards against took 1.1 s) after the failure,
# no rank finishes training, and the job ends within BOUND seconds (the ranks' own timeout is 60 s: the failure must be
# noticed long before it); for kill_saving, also when the checkpoint of the first save verifies (TOOL) and the second
# left only the dead rank's partial file. The times come from failure.cpp: the failing rank prints when it fails and
# the interval, every other rank when it caught the error (steady_clock, one clock on a host); measured on one host:
# about 100-110 ms after a SIGKILL, a few ms after a throw.
cmake_minimum_required(VERSION 3.25)

include("${CMAKE_CURRENT_LIST_DIR}/../require_defined.cmake")
require_defined(run_failure.cmake MPIEXEC NUMPROC_FLAG NP EXE MODE BOUND)

if(NOT DEFINED MARGIN_MS)
  set(MARGIN_MS 800)
endif()
math(EXPR victim "${NP} - 1")
if(MODE MATCHES "^kill(_saving)?$")
  set(expected "rank ${victim} \\(process [0-9]+ on this host\\) is gone")
elseif(MODE STREQUAL "throw")
  set(expected "rank ${victim} failed: its tandem::Mpi was destroyed by an exception")
elseif(MODE STREQUAL "abort")
  set(expected "rank ${victim} failed: injected failure on rank ${victim} at step 5")
else()
  message(FATAL_ERROR "run_failure.cmake: MODE must be kill, kill_saving, throw or abort (got '${MODE}')")
endif()
set(args ${MODE})
if(MODE STREQUAL "kill_saving")
  require_defined(run_failure.cmake DIR TOOL)
  file(REMOVE_RECURSE "${DIR}")
  list(APPEND args "${DIR}")
endif()

string(TIMESTAMP start "%s")
execute_process(COMMAND "${MPIEXEC}" ${NUMPROC_FLAG} ${NP} ${FLAGS} "${EXE}" ${args} TIMEOUT ${BOUND}
                RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE out)
string(TIMESTAMP end "%s")
math(EXPR seconds "${end} - ${start}")

set(problems "")
if(result MATCHES "timeout|Timeout")
  string(APPEND problems "  the job did not end within ${BOUND} s (a hang)\n")
endif()
if(out MATCHES "\\[mpi_failure\\] rank [0-9]+ finished")
  string(APPEND problems "  a rank finished training: nobody noticed the failure\n")
endif()
set(failed_at "")
if(out MATCHES "\\[mpi_failure\\] rank ${victim} fails at ([0-9]+) us; liveness interval ([0-9]+) ms")
  set(failed_at ${CMAKE_MATCH_1})
  math(EXPR limit_ms "${CMAKE_MATCH_2} + ${MARGIN_MS}")
else()
  string(APPEND problems "  rank ${victim} did not say when it failed (no line 'rank ${victim} fails at ... us')\n")
endif()
set(delays "")
math(EXPR last_survivor "${NP} - 2")
foreach(rank RANGE 0 ${last_survivor})
  if(NOT out MATCHES "\\[mpi_failure\\] rank ${rank} caught tandem::peer_error at ([0-9]+) us: tandem: [^\n]*${expected}")
    string(APPEND problems "  rank ${rank} did not report a tandem::peer_error matching '${expected}'\n")
  elseif(NOT failed_at STREQUAL "")
    set(caught_at ${CMAKE_MATCH_1})
    math(EXPR delay_ms "(${caught_at} - ${failed_at}) / 1000")
    string(APPEND delays " rank ${rank}: ${delay_ms} ms;")
    if(caught_at LESS failed_at)  # the ranks' steady clocks are not one clock (not on one host?): no measurement
      string(APPEND problems "  rank ${rank} reported before rank ${victim} failed (${delay_ms} ms): not one clock\n")
    elseif(delay_ms GREATER limit_ms)
      string(APPEND problems "  rank ${rank} reported ${delay_ms} ms after rank ${victim} failed; the bound is the "
                             "liveness interval + ${MARGIN_MS} ms = ${limit_ms} ms\n")
    endif()
  endif()
endforeach()

# kill_saving: the checkpoint of the save before stays, whole (tandem_checkpoint verify reads every byte), and of the
# save the rank died in only its partial temporary file is left (the other ranks removed their files as they failed).
if(MODE STREQUAL "kill_saving")
  execute_process(COMMAND "${TOOL}" verify "${DIR}" RESULT_VARIABLE rc OUTPUT_VARIABLE verified ERROR_VARIABLE verified)
  if(NOT rc EQUAL 0 OR NOT verified MATCHES ": step 4, saved by GradientSharded at ${NP} ranks[^\n]*: verified")
    string(APPEND problems "  the checkpoint saved before the failure does not verify (${rc}): ${verified}\n")
  endif()
  file(GLOB shards RELATIVE "${DIR}" "${DIR}/*.safetensors")
  file(GLOB partial RELATIVE "${DIR}" "${DIR}/*.safetensors.tmp*")
  list(LENGTH shards shard_count)
  list(LENGTH partial partial_count)
  if(NOT shard_count EQUAL NP OR NOT partial_count EQUAL 1)
    string(APPEND problems "  ${DIR} holds ${shard_count} shard files (${NP} expected) and ${partial_count} temporary "
                           "ones (1 expected): ${shards} ${partial}\n")
  endif()
endif()

if(problems)
  message(FATAL_ERROR "mpi_failure ${MODE} (${NP} ranks, ${seconds} s, exit ${result}):\n${problems}output:\n${out}")
endif()
message(STATUS "mpi_failure ${MODE}: every other rank named rank ${victim}, after the failure:${delays} bound "
               "${limit_ms} ms; job ${seconds} s\n${out}")
