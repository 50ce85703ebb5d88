# SPDX-License-Identifier: Apache-2.0
#
# tandem's optional MPI target. Included by the build tree (CMakeLists.txt) and by the installed tandemConfig.cmake,
# so that both define it the same way:
#
#   tandem::mpi  INTERFACE: tandem::tandem + MPI's C API for C++ (MPI::MPI_CXX without the deprecated C++
#                bindings), for <tandem/comm/mpi.hpp>
#
# FindMPI looks only for enabled languages; tandem is a C++ project, so it asks for the CXX component (the C API
# as seen from C++) and sets MPI_CXX_SKIP_MPICXX unless the caller decided otherwise.
#
# Input:  _tandem_mpi_scope  "GLOBAL" (build tree: a parent project must see the target) or empty.
# Output: TANDEM_MPI_FOUND.

# A target MPI::MPI_CXX made by the caller is trusted; one made here counts only if FindMPI also found MPI (without an
# MPI installed, FindMPI's pkg-config fallback can leave an empty MPI::MPI_CXX behind).
set(_tandem_mpi_usable TRUE)
if(NOT TARGET MPI::MPI_CXX)
  # (Set for this lookup only: the installed config runs in its caller's scope, whose own setting stays its own.)
  set(_tandem_skip_set FALSE)
  if(NOT DEFINED MPI_CXX_SKIP_MPICXX)
    set(MPI_CXX_SKIP_MPICXX TRUE)
    set(_tandem_skip_set TRUE)
  endif()
  find_package(MPI QUIET COMPONENTS CXX)
  set(_tandem_mpi_usable ${MPI_CXX_FOUND})
  if(_tandem_skip_set)
    unset(MPI_CXX_SKIP_MPICXX)
  endif()
endif()

set(TANDEM_MPI_FOUND FALSE)
if(TARGET MPI::MPI_CXX AND _tandem_mpi_usable)
  set(TANDEM_MPI_FOUND TRUE)
  if(NOT TARGET tandem::mpi)
    add_library(tandem::mpi INTERFACE IMPORTED ${_tandem_mpi_scope})
    target_link_libraries(tandem::mpi INTERFACE tandem::tandem MPI::MPI_CXX)
  endif()
endif()
