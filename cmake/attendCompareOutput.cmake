# SPDX-License-Identifier: MIT
# cmake -DPROGRAM=<exe> -DEXPECTED=<file> -DACTUAL=<file> [-DLAUNCHER="mpiexec -n 2"] -P attendCompareOutput.cmake
# Runs PROGRAM (through LAUNCHER, a space-separated command line, when given) and requires exit code 0 and stdout
# byte-for-byte equal to EXPECTED. The output is kept in ACTUAL; on a mismatch it is shown as a diff (after
# reading it, refresh with: cp ACTUAL EXPECTED).
separate_arguments(launcher UNIX_COMMAND "${LAUNCHER}")
execute_process(COMMAND ${launcher} ${PROGRAM} RESULT_VARIABLE result OUTPUT_VARIABLE actual)
file(WRITE ${ACTUAL} "${actual}")
if(NOT result EQUAL 0)
  message("${actual}")
  message(FATAL_ERROR "${PROGRAM} exited with ${result} (its stdout is above)")
endif()
file(READ ${EXPECTED} expected)
if(actual STREQUAL expected)
  return()
endif()
find_program(DIFF diff)
if(DIFF)
  execute_process(COMMAND ${DIFF} -u ${EXPECTED} ${ACTUAL})
else()
  message("--- expected\n${expected}\n+++ actual\n${actual}")
endif()
message(FATAL_ERROR "stdout of ${PROGRAM} differs from ${EXPECTED} (diff above: - expected, + actual)")
