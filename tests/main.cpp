// SPDX-License-Identifier: Apache-2.0
// main() of every host test executable (the tandem_test_main library): doctest's, with the exit codes of
// support/cases.hpp (77 for a case that called test::skip_case; a case that made no check fails).
#define DOCTEST_CONFIG_IMPLEMENT
#define TANDEM_TEST_CASES_MAIN
#include "support/cases.hpp"

int main(int argc, char** argv) { return test::run_cases(argc, argv); }
