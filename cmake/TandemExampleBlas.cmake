# SPDX-License-Identifier: Apache-2.0
#
# tandem_example_blas: CBLAS from OpenBLAS for the tiny transformer example and its tests (not part of the library,
# which needs no BLAS). Defines the INTERFACE target tandem_example_blas when OpenBLAS and cblas.h are found
# (Debian: libopenblas-dev), with TINY_HAVE_OPENBLAS_THREADS when openblas_set_num_threads exists and
# TINY_HAVE_OPENBLAS_CORENAME when openblas_get_corename and openblas_get_config do (the example says which kernels it
# runs on: examples/tiny_transformer/blas_core.hpp).
include_guard(GLOBAL)

set(BLA_VENDOR OpenBLAS)
find_package(BLAS QUIET)
find_path(TANDEM_CBLAS_INCLUDE_DIR cblas.h PATH_SUFFIXES openblas)
if(BLAS_FOUND AND TANDEM_CBLAS_INCLUDE_DIR)
  add_library(tandem_example_blas INTERFACE)
  target_link_libraries(tandem_example_blas INTERFACE ${BLAS_LIBRARIES} ${CMAKE_DL_LIBS})  # dladdr: the BLAS's file
  target_include_directories(tandem_example_blas SYSTEM INTERFACE "${TANDEM_CBLAS_INCLUDE_DIR}")
  # The model's row loops (exp, GELU, softmax) vectorize only when FP comparisons may be if-converted (no trapping
  # math) and with -O3's vectorizer at every build type; nothing here reads floating-point exception flags. The
  # example is built to run where it is built, so it uses the machine's vector width (AVX2 and FMA where present, as
  # PyTorch and OpenBLAS pick at run time); TANDEM_EXAMPLE_NATIVE=OFF builds a portable binary.
  option(TANDEM_EXAMPLE_NATIVE "Build the tiny transformer for this machine's CPU (-march=native)" ON)
  # Host compiler flags only: nvcc translation units (the CUDA path) do not take them.
  target_compile_options(tandem_example_blas INTERFACE "$<$<COMPILE_LANG_AND_ID:CXX,GNU,Clang>:-O3;-fno-trapping-math>")
  if(TANDEM_EXAMPLE_NATIVE)
    include(CheckCXXCompilerFlag)
    check_cxx_compiler_flag(-march=native TANDEM_HAVE_MARCH_NATIVE)
    if(TANDEM_HAVE_MARCH_NATIVE)
      target_compile_options(tandem_example_blas INTERFACE "$<$<COMPILE_LANGUAGE:CXX>:-march=native>")
    endif()
  endif()
  include(CheckCXXSymbolExists)
  include(CMakePushCheckState)
  cmake_push_check_state(RESET)
  set(CMAKE_REQUIRED_LIBRARIES ${BLAS_LIBRARIES})
  set(CMAKE_REQUIRED_INCLUDES "${TANDEM_CBLAS_INCLUDE_DIR}")
  set(CMAKE_REQUIRED_QUIET ON)
  check_cxx_symbol_exists(openblas_set_num_threads cblas.h TANDEM_HAVE_OPENBLAS_THREADS)
  check_cxx_symbol_exists(openblas_get_corename cblas.h TANDEM_HAVE_OPENBLAS_CORENAME)
  check_cxx_symbol_exists(openblas_get_config cblas.h TANDEM_HAVE_OPENBLAS_CONFIG)
  cmake_pop_check_state()
  if(TANDEM_HAVE_OPENBLAS_THREADS)
    target_compile_definitions(tandem_example_blas INTERFACE TINY_HAVE_OPENBLAS_THREADS)
  endif()
  if(TANDEM_HAVE_OPENBLAS_CORENAME AND TANDEM_HAVE_OPENBLAS_CONFIG)
    target_compile_definitions(tandem_example_blas INTERFACE TINY_HAVE_OPENBLAS_CORENAME)
  endif()
else()
  message(STATUS "tandem: OpenBLAS with cblas.h not found (Debian: libopenblas-dev); the tiny transformer is skipped")
endif()
