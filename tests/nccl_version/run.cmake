# SPDX-License-Identifier: Apache-2.0
#
# tandem needs NCCL 2.14 (ncclCommInitRankConfig, ncclCommFinalize, non-blocking communicators); an older one is
# refused where it is met, with the version in the sentence (ctest nccl_minimum_version):
#   cmake -DCXX=<c++> -DSOURCE_DIR=<tandem source> -DNCCL_INCLUDE_DIR=<the nccl.h found> -DNCCL_LIBRARY=<libnccl>
#         "-DCUDA_INCLUDE_DIRS=<the toolkit's include directories>" -DWORK_DIR=<scratch> -DGENERATOR=<generator>
#         [-DMAKE_PROGRAM=<ninja>] -P run.cmake
# It writes a copy of the real nccl.h that says 2.12.3, then
# - compiles <tandem/comm/nccl.hpp> against each: the copy must stop at tandem's #error, the real one must compile
#   (so that the copy fails for its version alone);
# - configures a project that includes cmake/tandemCudaTargets.cmake with each as TANDEM_NCCL_INCLUDE_DIR: the copy
#   must give no tandem::nccl, TANDEM_NCCL_FOUND false and the reason in TANDEM_NCCL_PROBLEM (which the top-level
#   status line and find_package(tandem COMPONENTS nccl)'s failure print); the real one tandem::nccl.
cmake_minimum_required(VERSION 3.25)

include("${CMAKE_CURRENT_LIST_DIR}/../require_defined.cmake")
require_defined(nccl_version/run.cmake CXX SOURCE_DIR NCCL_INCLUDE_DIR NCCL_LIBRARY WORK_DIR GENERATOR)

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}/old")
file(READ "${NCCL_INCLUDE_DIR}/nccl.h" header)
foreach(define IN ITEMS "NCCL_MAJOR 2" "NCCL_MINOR 12" "NCCL_PATCH 3" "NCCL_VERSION_CODE 21203")
  string(REGEX MATCH "^[A-Z_]+" name "${define}")
  string(REGEX REPLACE "#define ${name} +[0-9]+" "#define ${define}" changed "${header}")
  if(changed STREQUAL header AND NOT header MATCHES "#define ${define}\n")
    message(FATAL_ERROR "nccl_version: ${NCCL_INCLUDE_DIR}/nccl.h has no '#define ${name} <number>' to change")
  endif()
  set(header "${changed}")
endforeach()
file(WRITE "${WORK_DIR}/old/nccl.h" "${header}")

# The header: the copy stops at tandem's #error, the real nccl.h compiles.
file(WRITE "${WORK_DIR}/include_nccl.cpp" "#include <tandem/comm/nccl.hpp>\nint main() { return 0; }\n")
set(includes "-I${SOURCE_DIR}/include")
foreach(dir IN LISTS CUDA_INCLUDE_DIRS)
  list(APPEND includes "-I${dir}")
endforeach()
foreach(case IN ITEMS old real)
  if(case STREQUAL "old")
    set(nccl_dir "${WORK_DIR}/old")
  else()
    set(nccl_dir "${NCCL_INCLUDE_DIR}")
  endif()
  execute_process(COMMAND "${CXX}" -std=c++20 -fsyntax-only "-I${nccl_dir}" ${includes} "${WORK_DIR}/include_nccl.cpp"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  set(refusal "tandem needs NCCL 2\\.14 or later \\(ncclCommInitRankConfig")
  if(case STREQUAL "old" AND (rc EQUAL 0 OR NOT out MATCHES "${refusal}"))
    message(FATAL_ERROR "nccl_version: <tandem/comm/nccl.hpp> against NCCL 2.12.3 gave exit code ${rc}, not tandem's "
                        "#error:\n${out}")
  elseif(case STREQUAL "real" AND NOT rc EQUAL 0)
    message(FATAL_ERROR "nccl_version: <tandem/comm/nccl.hpp> against ${NCCL_INCLUDE_DIR}/nccl.h failed (${rc}):\n"
                        "${out}")
  endif()
endforeach()

# The CMake targets.
file(WRITE "${WORK_DIR}/project/CMakeLists.txt" "cmake_minimum_required(VERSION 3.25)
project(nccl_version LANGUAGES CXX)
add_library(tandem::tandem INTERFACE IMPORTED)
set(_tandem_cuda_scope \"\")
include(\"${SOURCE_DIR}/cmake/tandemCudaTargets.cmake\")
if(TARGET tandem::nccl)
  set(target yes)
else()
  set(target no)
endif()
message(STATUS \"result: found \${TANDEM_NCCL_FOUND}, tandem::nccl \${target}, version \${TANDEM_NCCL_VERSION}, \"
               \"problem '\${TANDEM_NCCL_PROBLEM}'\")
")
set(generator_args -G "${GENERATOR}" "-DCMAKE_CXX_COMPILER=${CXX}")
if(MAKE_PROGRAM)
  list(APPEND generator_args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()
foreach(case IN ITEMS old real)
  if(case STREQUAL "old")
    set(nccl_dir "${WORK_DIR}/old")
    set(expect "found FALSE, tandem::nccl no, version 2\\.12\\.3, problem 'NCCL 2\\.12\\.3 \\([^)]*/old/nccl\\.h\\) is "
               "older than 2\\.14, which tandem needs'")
  else()
    set(nccl_dir "${NCCL_INCLUDE_DIR}")
    set(expect "found TRUE, tandem::nccl yes, version [0-9]+\\.[0-9]+\\.[0-9]+, problem ''")
  endif()
  string(CONCAT expect ${expect})
  execute_process(COMMAND "${CMAKE_COMMAND}" -S "${WORK_DIR}/project" -B "${WORK_DIR}/build-${case}" ${generator_args}
                          "-DTANDEM_NCCL_INCLUDE_DIR=${nccl_dir}" "-DTANDEM_NCCL_LIBRARY=${NCCL_LIBRARY}"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "-- result: ${expect}\n")
    message(FATAL_ERROR "nccl_version: the targets with the ${case} nccl.h (exit code ${rc}) did not say\n  "
                        "${expect}\n${out}")
  endif()
endforeach()
message(STATUS "nccl_version: NCCL 2.12.3 refused by the header and by the targets; ${NCCL_INCLUDE_DIR}/nccl.h taken")
