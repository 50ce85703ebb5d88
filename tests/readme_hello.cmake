# SPDX-License-Identifier: Apache-2.0
# Fails unless README.md's C++ block is examples/hello.cpp from its first #include on: the README shows
# exactly the code the build compiles and the tests run.
file(READ "${README}" readme)
file(READ "${HELLO}" hello)
string(FIND "${hello}" "#include <cstdio>" start)
string(SUBSTRING "${hello}" ${start} -1 hello_code)
string(FIND "${readme}" "${hello_code}" found)
if(found EQUAL -1)
  message(FATAL_ERROR "README.md's hello world differs from examples/hello.cpp; copy the file's code into the README")
endif()
