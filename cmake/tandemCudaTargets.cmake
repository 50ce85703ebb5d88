# SPDX-License-Identifier: Apache-2.0
#
# tandem's optional CUDA and NCCL targets. Included by the build tree (CMakeLists.txt) and by the installed
# tandemConfig.cmake, so that both define them the same way:
#
#   tandem::cuda  INTERFACE: tandem::tandem + CUDA::cudart + CCCL::CCCL (CUB and libcu++ from the same toolkit, by
#                 its CCCL package; a toolkit without one gives CUB through its include directory).
#                 CUDA::cudart_static instead where TANDEM_CUDA_STATIC_RUNTIME is ON (binaries that travel to a
#                 machine whose libcudart may differ: tools/gpu-check's bundle).
#   tandem::nccl  INTERFACE: tandem::cuda + NCCL (nccl.h and libnccl; looked for next to the CUDA toolkit first,
#                 then under NCCL_ROOT / NCCL_HOME, then in the system paths)
#
# Input:  _tandem_cuda_scope  "GLOBAL" (build tree: a parent project must see the targets) or empty.
# Output: TANDEM_CUDA_FOUND, TANDEM_NCCL_FOUND, TANDEM_NCCL_VERSION, TANDEM_NCCL_PROBLEM (why an nccl.h and libnccl
#         that were found are not used: an NCCL older than TANDEM_NCCL_MINIMUM); cache: TANDEM_NCCL_INCLUDE_DIR,
#         TANDEM_NCCL_LIBRARY.

if(NOT TARGET CUDA::cudart)
  find_package(CUDAToolkit QUIET ${_tandem_cuda_scope})
endif()

set(TANDEM_CUDA_FOUND FALSE)
set(TANDEM_NCCL_FOUND FALSE)
set(TANDEM_NCCL_VERSION "")
set(TANDEM_NCCL_PROBLEM "")
# ncclCommInitRankConfig, ncclCommFinalize and non-blocking communicators (ncclInProgress) came in NCCL 2.14
# (comm/nccl.hpp checks the same at compile time).
set(TANDEM_NCCL_MINIMUM 2.14)

if(TARGET CUDA::cudart)
  set(TANDEM_CUDA_FOUND TRUE)
  if(NOT TARGET tandem::cuda)
    # The toolkit's own CCCL, not another copy on the system: only its cmake directory is searched.
    if(NOT TARGET CCCL::CCCL)
      find_package(CCCL CONFIG QUIET COMPONENTS CUB libcudacxx NO_DEFAULT_PATH
                   PATHS "${CUDAToolkit_LIBRARY_DIR}/cmake" "${CUDAToolkit_LIBRARY_ROOT}/lib64/cmake")
    endif()
    add_library(tandem::cuda INTERFACE IMPORTED ${_tandem_cuda_scope})
    # .cu files that include tandem need C++20 too: cxx_std_20 (tandem::tandem's) covers C++ only, and CMake < 3.26
    # knows no C++20 flag for nvcc (a consumer's CUDA_STANDARD 20 adds nothing there). nvcc takes the flag twice.
    target_compile_options(tandem::cuda INTERFACE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
    if(TANDEM_CUDA_STATIC_RUNTIME AND TARGET CUDA::cudart_static)
      target_link_libraries(tandem::cuda INTERFACE tandem::tandem CUDA::cudart_static)
    else()
      target_link_libraries(tandem::cuda INTERFACE tandem::tandem CUDA::cudart)
    endif()
    if(TARGET CCCL::CCCL)
      target_link_libraries(tandem::cuda INTERFACE CCCL::CCCL)
      # CCCL's component targets are not imported ones, so their headers would reach a consumer as ordinary
      # includes (and its warning flags would apply to them): mark them system, as the toolkit's other headers are.
      foreach(_tandem_cccl IN ITEMS CCCL::CUB CCCL::libcudacxx)
        if(TARGET ${_tandem_cccl})
          get_target_property(_tandem_cccl_real ${_tandem_cccl} ALIASED_TARGET)
          if(_tandem_cccl_real)
            set_property(TARGET ${_tandem_cccl_real} PROPERTY SYSTEM TRUE)
          endif()
        endif()
      endforeach()
    endif()
  endif()

  find_path(
    TANDEM_NCCL_INCLUDE_DIR nccl.h
    HINTS ${CUDAToolkit_INCLUDE_DIRS} ENV NCCL_ROOT ENV NCCL_HOME
    PATH_SUFFIXES include
    DOC "Directory holding nccl.h")
  find_library(
    TANDEM_NCCL_LIBRARY nccl
    HINTS ${CUDAToolkit_LIBRARY_DIR} ENV NCCL_ROOT ENV NCCL_HOME
    PATH_SUFFIXES lib64 lib
    DOC "The NCCL library")
  mark_as_advanced(TANDEM_NCCL_INCLUDE_DIR TANDEM_NCCL_LIBRARY)

  if(TANDEM_NCCL_INCLUDE_DIR AND TANDEM_NCCL_LIBRARY)
    file(STRINGS "${TANDEM_NCCL_INCLUDE_DIR}/nccl.h" _tandem_nccl_defines REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
    foreach(_tandem_part IN ITEMS MAJOR MINOR PATCH)
      string(REGEX MATCH "NCCL_${_tandem_part} +([0-9]+)" _tandem_match "${_tandem_nccl_defines}")
      list(APPEND TANDEM_NCCL_VERSION "${CMAKE_MATCH_1}")
    endforeach()
    list(JOIN TANDEM_NCCL_VERSION "." TANDEM_NCCL_VERSION)
    if(NOT TANDEM_NCCL_VERSION MATCHES "^[0-9]+\\.[0-9]+\\.[0-9]+$")
      set(TANDEM_NCCL_PROBLEM "${TANDEM_NCCL_INCLUDE_DIR}/nccl.h defines no NCCL_MAJOR, NCCL_MINOR and NCCL_PATCH")
    elseif(TANDEM_NCCL_VERSION VERSION_LESS TANDEM_NCCL_MINIMUM)
      string(CONCAT TANDEM_NCCL_PROBLEM "NCCL ${TANDEM_NCCL_VERSION} (${TANDEM_NCCL_INCLUDE_DIR}/nccl.h) is older "
                    "than ${TANDEM_NCCL_MINIMUM}, which tandem needs")
    else()
      set(TANDEM_NCCL_FOUND TRUE)
    endif()
  endif()
  if(TANDEM_NCCL_FOUND)
    if(NOT TARGET tandem::nccl)
      add_library(tandem::nccl INTERFACE IMPORTED ${_tandem_cuda_scope})
      target_include_directories(tandem::nccl INTERFACE "${TANDEM_NCCL_INCLUDE_DIR}")
      target_link_libraries(tandem::nccl INTERFACE tandem::cuda "${TANDEM_NCCL_LIBRARY}")
    endif()
  endif()
endif()
