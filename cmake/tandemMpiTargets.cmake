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

if(NOT TARGET MPI::MPI_CXX)
  if(NOT DEFINED MPI_CXX_SKIP_MPICXX)
    set(MPI_CXX_SKIP_MPICXX TRUE)
  endif()
  find_package(MPI QUIET COMPONENTS CXX)
endif()

set(TANDEM_MPI_FOUND FALSE)
if(TARGET MPI::MPI_CXX)
  set(TANDEM_MPI_FOUND TRUE)
  if(NOT TARGET tandem::mpi)
    add_library(tandem::mpi INTERFACE IMPORTED ${_tandem_mpi_scope})
    target_link_libraries(tandem::mpi INTERFACE tandem::tandem MPI::MPI_CXX)
  endif()
endif()
