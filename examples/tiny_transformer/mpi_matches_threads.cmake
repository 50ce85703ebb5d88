# SPDX-License-Identifier: Apache-2.0
#
# cmake -DMPIEXEC=... -DNUMPROC_FLAG=-n -DFLAGS="..." -DEXE=tiny_transformer -P mpi_matches_threads.cmake
#
# Trains the tiny transformer twice under ZeRO-2, as 2 MPI processes and as 2 threads of one process, and checks
# that the trained parameters' fingerprints are equal: tandem::Mpi and tandem::LocalGroup give bitwise the same run.
# Host ranks on both sides, also on machines with GPUs.
set(args --backend host --steps 12 --batch 8 --eval 64 --policy gradient-sharded --accum 2)
execute_process(COMMAND ${MPIEXEC} ${NUMPROC_FLAG} 2 ${FLAGS} ${EXE} ${args} OUTPUT_VARIABLE mpi_out
                ERROR_VARIABLE mpi_err RESULT_VARIABLE mpi_rc TIMEOUT 240)
execute_process(COMMAND ${EXE} ${args} --ranks 2 OUTPUT_VARIABLE threads_out ERROR_VARIABLE threads_err
                RESULT_VARIABLE threads_rc TIMEOUT 240)
if(NOT mpi_rc EQUAL 0 OR NOT threads_rc EQUAL 0)
  message(FATAL_ERROR "a run failed (mpirun: ${mpi_rc}, threads: ${threads_rc})\n${mpi_out}${mpi_err}\n${threads_out}${threads_err}")
endif()
string(REGEX MATCH "fingerprint ([0-9a-f]+)" _ "${mpi_out}")
set(mpi_fp "${CMAKE_MATCH_1}")
string(REGEX MATCH "fingerprint ([0-9a-f]+)" _ "${threads_out}")
set(threads_fp "${CMAKE_MATCH_1}")
if(NOT mpi_out MATCHES "each process is one rank")
  message(FATAL_ERROR "the mpirun run did not use tandem::Mpi:\n${mpi_out}")
endif()
if(mpi_fp STREQUAL "" OR NOT mpi_fp STREQUAL threads_fp)
  message(FATAL_ERROR "2 MPI processes gave '${mpi_fp}', 2 threads '${threads_fp}'\n${mpi_out}\n${threads_out}")
endif()
message(STATUS "2 MPI processes and 2 threads trained the same parameters (fingerprint ${mpi_fp})")
