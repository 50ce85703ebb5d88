// SPDX-License-Identifier: Apache-2.0
// doctest's main(), shared by every test executable (the tandem_test_main library).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
