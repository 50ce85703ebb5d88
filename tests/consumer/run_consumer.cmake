# SPDX-License-Identifier: Apache-2.0
#
# Builds and runs tests/consumer against tandem, from ctest (tests consumer_package / consumer_subdirectory):
#   cmake -DMODE=package|subdirectory|fetchcontent -DSOURCE_DIR=<tandem source> -DCONSUMER_DIR=<tests/consumer>
#         -DWORK_DIR=<scratch dir> -DGENERATOR=<generator> [-DMAKE_PROGRAM=<ninja>] [-DCXX_COMPILER=<c++>]
#         [-DBUILD_TYPE=<config>] [-DVERSION=<tandem version>] [-DCUDA=ON [-DCUDA_COMPILER=<nvcc>]]
#         -P run_consumer.cmake
# package:      configure tandem (tests, examples, benchmarks and CUDA off; the tools on without CUDA=ON), install it
#               into WORK_DIR/prefix, run the installed tools, then build the consumer with find_package(tandem
#               VERSION) against that prefix.
# subdirectory: build the consumer with add_subdirectory(SOURCE_DIR); fetchcontent: with FetchContent from SOURCE_DIR.
#               In both, tandem's tests, examples, benchmarks and tools must default OFF; tandem must not enable CUDA
#               nor write CUDA settings into the cache (the consumer is C++ only; nvcc may exist); and the consumer
#               must see tandem's headers as system headers.
# All then run the consumer and check that it prints "tandem VERSION". With CUDA=ON (package mode), the consumer is a
# CUDA project too and its main.cu, built with tandem::cuda alone, runs as well (it launches nothing without a GPU).
cmake_minimum_required(VERSION 3.25)

include("${CMAKE_CURRENT_LIST_DIR}/../require_defined.cmake")
require_defined(run_consumer.cmake MODE SOURCE_DIR CONSUMER_DIR WORK_DIR GENERATOR)
if(NOT BUILD_TYPE)
  set(BUILD_TYPE Release)
endif()

# run(<step> <command>...): runs the command, echoing its output only when it fails.
function(run step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT result EQUAL 0)
    list(JOIN ARGN " " command)
    message(FATAL_ERROR "consumer (${MODE}): ${step} failed (${result}):\n  ${command}\n${out}")
  endif()
  set(run_output "${out}" PARENT_SCOPE)
endfunction()

set(common_args -G "${GENERATOR}" "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}" -DCMAKE_EXPORT_COMPILE_COMMANDS=ON)
if(MAKE_PROGRAM)
  list(APPEND common_args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()
if(CXX_COMPILER)
  list(APPEND common_args "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
endif()

set(cuda_args "")
if(CUDA)
  if(NOT MODE STREQUAL "package")
    message(FATAL_ERROR "run_consumer.cmake: CUDA=ON is for MODE=package")
  endif()
  set(cuda_args -DTANDEM_CONSUMER_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)  # (one architecture: the compile only)
  if(CUDA_COMPILER)
    list(APPEND cuda_args "-DCMAKE_CUDA_COMPILER=${CUDA_COMPILER}")
  endif()
endif()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(consumer_build "${WORK_DIR}/consumer-build")

if(MODE STREQUAL "package")
  set(tandem_build "${WORK_DIR}/tandem-build")
  set(prefix "${WORK_DIR}/prefix")
  # The tools are built and installed in the package mode without CUDA (one build of them is enough).
  if(CUDA)
    set(tools OFF)
  else()
    set(tools ON)
  endif()
  run("configure tandem" "${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${tandem_build}" ${common_args}
      -DTANDEM_ENABLE_CUDA=OFF -DTANDEM_BUILD_TESTS=OFF -DTANDEM_BUILD_EXAMPLES=OFF -DTANDEM_BUILD_BENCHMARKS=OFF
      -DTANDEM_BUILD_TOOLS=${tools} "-DCMAKE_INSTALL_PREFIX=${prefix}")
  run("build tandem" "${CMAKE_COMMAND}" --build "${tandem_build}" --config "${BUILD_TYPE}")
  run("install tandem" "${CMAKE_COMMAND}" --install "${tandem_build}" --config "${BUILD_TYPE}")
  # The installed tools run from the prefix: tandem_checkpoint's usage, and tandem_memory's table for a model size.
  set(bin "${prefix}/bin")  # (CMAKE_INSTALL_BINDIR's default)
  if(tools)
    foreach(check IN ITEMS "tandem_checkpoint;--help;^usage: tandem_checkpoint verify DIR\n"
                           "tandem_memory;--params;1e6;--world;2;\n[|] ParameterSharded [|] owned [|] bf16 [|]")
      list(POP_BACK check expected)
      list(POP_FRONT check tool)
      run("run the installed ${tool}" "${bin}/${tool}" ${check})
      if(NOT run_output MATCHES "${expected}")
        message(FATAL_ERROR "consumer (package): the installed ${tool} printed no match of '${expected}':\n"
                            "${run_output}")
      endif()
    endforeach()
  elseif(EXISTS "${bin}")
    message(FATAL_ERROR "consumer (package): TANDEM_BUILD_TOOLS=OFF installed ${bin}")
  endif()
  run("configure consumer" "${CMAKE_COMMAND}" -S "${CONSUMER_DIR}" -B "${consumer_build}" ${common_args}
      -DTANDEM_CONSUMER_MODE=package "-DTANDEM_EXPECTED_VERSION=${VERSION}" "-DCMAKE_PREFIX_PATH=${prefix}"
      -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF ${cuda_args})
  # find_package must have picked the fresh install, not some other tandem on this machine.
  file(STRINGS "${consumer_build}/CMakeCache.txt" found_dir REGEX "^tandem_DIR:")
  string(FIND "${found_dir}" "${prefix}/" at)
  if(NOT at GREATER -1)
    message(FATAL_ERROR "consumer (package): find_package(tandem) used ${found_dir}, not the install in ${prefix}")
  endif()
elseif(MODE MATCHES "^(subdirectory|fetchcontent)$")
  run("configure consumer" "${CMAKE_COMMAND}" -S "${CONSUMER_DIR}" -B "${consumer_build}" ${common_args}
      -DTANDEM_CONSUMER_MODE=${MODE} "-DTANDEM_SOURCE_DIR=${SOURCE_DIR}")
  # As a subproject, tandem must not build its tests, examples or benchmarks by default ...
  file(STRINGS "${consumer_build}/CMakeCache.txt" on_by_default REGEX "^TANDEM_BUILD_[A-Z]+:BOOL=ON$")
  if(on_by_default)
    message(FATAL_ERROR "consumer (${MODE}): defaults must be OFF for a subproject, got: ${on_by_default}")
  endif()
  # ... nor enable a language or choose architectures for its consumer ...
  file(STRINGS "${consumer_build}/CMakeCache.txt" cuda_settings REGEX "^CMAKE_CUDA_[A-Z_]+:")
  if(cuda_settings)
    message(FATAL_ERROR "consumer (${MODE}): tandem enabled CUDA or wrote CUDA settings: ${cuda_settings}")
  endif()
  # ... and its headers are system headers to the consumer (their warnings are not the consumer's).
  file(READ "${consumer_build}/compile_commands.json" commands)
  string(FIND "${commands}" "-isystem ${SOURCE_DIR}/include" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "consumer (${MODE}): tandem's include directory is not a system one:\n${commands}")
  endif()
else()
  message(FATAL_ERROR "run_consumer.cmake: MODE must be package, subdirectory or fetchcontent (got '${MODE}')")
endif()

run("build consumer" "${CMAKE_COMMAND}" --build "${consumer_build}" --config "${BUILD_TYPE}")
set(programs consumer)
if(CUDA)
  list(APPEND programs consumer_cuda)
endif()
foreach(program IN LISTS programs)
  run("run ${program}" "${consumer_build}/bin/${program}")
  message(STATUS "${program} (${MODE}): ${run_output}")
  string(FIND "${run_output}" "tandem ${VERSION}" at)
  if(VERSION AND at EQUAL -1)
    message(FATAL_ERROR "${program} (${MODE}): expected 'tandem ${VERSION}' in the output, got: ${run_output}")
  endif()
endforeach()
