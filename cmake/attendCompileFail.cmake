# SPDX-License-Identifier: MIT
# cmake "-DCOMMAND=<compiler>|<flags>|...|<file>" -DEXPECT=ok|ko -DSOURCE=<file> -P attendCompileFail.cmake
# Runs COMMAND (the compiler checking SOURCE; `|` separates arguments). ok: it must succeed. ko: it must fail,
# and every `// expect-error: <text>` line of SOURCE must appear in the compiler output, so a ko file fails for
# the reason it claims.
string(REPLACE "|" ";" command "${COMMAND}")
execute_process(COMMAND ${CMAKE_COMMAND} -E env LC_ALL=C ${command}
  RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)

if(EXPECT STREQUAL "ok")
  if(NOT result EQUAL 0)
    message("${output}")
    message(FATAL_ERROR "${SOURCE} must compile but did not (compiler output above)")
  endif()
  message(STATUS "${SOURCE} compiles, as it must")
  return()
endif()

file(STRINGS ${SOURCE} markers REGEX "^[ \t]*// expect-error: ")
if(NOT markers)
  message(FATAL_ERROR "${SOURCE} has no `// expect-error: <text>` line saying why it must not compile")
endif()
if(result EQUAL 0)
  message(FATAL_ERROR "${SOURCE} compiled but must not")
endif()
foreach(marker IN LISTS markers)
  string(REGEX REPLACE "^[ \t]*// expect-error: *" "" expected "${marker}")
  string(FIND "${output}" "${expected}" found)
  if(found EQUAL -1)
    message("${output}")
    message(FATAL_ERROR "${SOURCE} failed to compile, but not with \"${expected}\" (compiler output above)")
  endif()
  message(STATUS "${SOURCE} fails to compile with \"${expected}\", as it must")
endforeach()
