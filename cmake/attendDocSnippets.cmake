# SPDX-License-Identifier: MIT
# The code of a docs/ page as a program that ctest builds and runs, so a page can never drift from the library.
#
# A page's fenced blocks, in order:
#   ```cpp     a block that starts with `#include` goes to file scope (includes, helper functions); any other
#              block goes into main(), after the blocks before it, so a page reads as one program in steps
#              (variables of one block are visible in the next).
#   ```output  what the blocks before it print; the program's stdout must equal all output blocks, in order,
#              byte for byte.
# Other blocks (```python, ```cmake, ```text, ...) are prose. The generated program includes <attend/attend.hpp>,
# <attend/interop/safetensors.hpp>, <cmath>, <iomanip>, <iostream>, <limits> and <string>, and has `data_dir`,
# the path of tests/data.
#
# Included: attend_doc_page(<page.md>) generates the program at configure time (cmake re-runs when the page
# changes), adds executable doc_<page> and ctest doc.<page> (label docs). That test runs this file as a script:
#   cmake -DPAGE=<page.md> -DSOURCE=<generated .cpp> -DPROGRAM=<exe> -DACTUAL=<file> -DDATA_DIR=<dir> -P <this>
# which reads the page again (a page edited since the build fails with "rebuild"), runs the program and compares
# its stdout with the page's output blocks.

if(CMAKE_SCRIPT_MODE_FILE)
  cmake_minimum_required(VERSION 3.16)
endif()

# The first line of `text` (without its newline) into out_line, the rest into out_rest (empty at the end).
function(attend_doc_split_line text out_line out_rest)
  string(FIND "${text}" "\n" eol)
  if(eol EQUAL -1)
    set(${out_line} "${text}" PARENT_SCOPE)
    set(${out_rest} "" PARENT_SCOPE)
    return()
  endif()
  string(SUBSTRING "${text}" 0 ${eol} line)
  math(EXPR eol "${eol} + 1")
  string(SUBSTRING "${text}" ${eol} -1 rest)
  set(${out_line} "${line}" PARENT_SCOPE)
  set(${out_rest} "${rest}" PARENT_SCOPE)
endfunction()

# The program and the expected output of `page`, into out_source and out_expected.
function(attend_doc_extract page data_dir out_source out_expected)
  file(READ ${page} text)
  set(file_scope "")
  set(body "")
  set(expected "")
  set(blocks 0)
  while(TRUE)
    # An opening fence at the start of a line: "```" and its info string up to the end of the line.
    string(FIND "${text}" "\n```" open)
    if(open EQUAL -1)
      break()
    endif()
    math(EXPR open "${open} + 4")
    string(SUBSTRING "${text}" ${open} -1 text)
    attend_doc_split_line("${text}" info text)
    string(STRIP "${info}" info)
    # The closing fence: the next line that starts with "```" (the block keeps its last newline).
    string(FIND "\n${text}" "\n```" close)
    if(close EQUAL -1)
      message(FATAL_ERROR "${page}: a ```${info} block is never closed")
    endif()
    string(SUBSTRING "${text}" 0 ${close} block)
    string(SUBSTRING "${text}" ${close} -1 text)
    attend_doc_split_line("${text}" fence text)
    set(text "\n${text}")  # the next opening fence starts a line
    if(info STREQUAL "cpp")
      math(EXPR blocks "${blocks} + 1")
      if(block MATCHES "^#include")
        string(APPEND file_scope "// block ${blocks}\n${block}")
      else()
        string(APPEND body "// block ${blocks}\n${block}")  # one scope: blocks share their variables
      endif()
    elseif(info STREQUAL "output")
      string(APPEND expected "${block}")
    endif()
  endwhile()
  if(blocks EQUAL 0)
    message(FATAL_ERROR "${page} has no ```cpp block")
  endif()
  get_filename_component(shown ${page} NAME)
  set(${out_source} "// Generated from docs/${shown} by cmake/attendDocSnippets.cmake: its ```cpp blocks as one program.
#include <cmath>
#include <iomanip>
#include <iostream>
#include <limits>
#include <string>

#include <attend/attend.hpp>
#include <attend/interop/safetensors.hpp>

namespace {
[[maybe_unused]] const std::string data_dir = \"${data_dir}\";
}  // namespace

${file_scope}
int main() {
${body}}
" PARENT_SCOPE)
  set(${out_expected} "${expected}" PARENT_SCOPE)
endfunction()

if(CMAKE_SCRIPT_MODE_FILE)
  attend_doc_extract(${PAGE} ${DATA_DIR} source expected)
  file(READ ${SOURCE} built)
  if(NOT built STREQUAL source)
    message(FATAL_ERROR "${PAGE} changed since doc program ${PROGRAM} was generated: rebuild, then test")
  endif()
  execute_process(COMMAND ${PROGRAM} RESULT_VARIABLE result OUTPUT_VARIABLE actual)
  file(WRITE ${ACTUAL} "${actual}")
  if(NOT result EQUAL 0)
    message("${actual}")
    message(FATAL_ERROR "${PROGRAM} exited with ${result} (its stdout is above)")
  endif()
  if(NOT actual STREQUAL expected)
    file(WRITE ${ACTUAL}.expected "${expected}")
    find_program(DIFF diff)
    if(DIFF)
      execute_process(COMMAND ${DIFF} -u ${ACTUAL}.expected ${ACTUAL})
    else()
      message("--- expected\n${expected}\n+++ actual\n${actual}")
    endif()
    message(FATAL_ERROR "stdout of ${PROGRAM} differs from the output blocks of ${PAGE} (diff above: - page, + "
      "program)")
  endif()
  return()
endif()

set(ATTEND_DOC_SNIPPETS_SCRIPT ${CMAKE_CURRENT_LIST_FILE})
function(attend_doc_page page)
  get_filename_component(name ${page} NAME_WE)
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${page})
  set(data_dir ${PROJECT_SOURCE_DIR}/tests/data)
  attend_doc_extract(${page} ${data_dir} source expected)
  set(generated ${CMAKE_CURRENT_BINARY_DIR}/snippets/doc_${name}.cpp)
  file(WRITE ${generated}.in "${source}")
  configure_file(${generated}.in ${generated} COPYONLY)  # rewritten only when it changes: no needless rebuilds
  add_executable(doc_${name} ${generated})
  target_link_libraries(doc_${name} PRIVATE attend::attend attend_kernels attend_warnings attend_sanitizers)
  add_test(NAME doc.${name} COMMAND ${CMAKE_COMMAND} -DPAGE=${page} -DSOURCE=${generated}
    -DPROGRAM=$<TARGET_FILE:doc_${name}> -DACTUAL=${CMAKE_CURRENT_BINARY_DIR}/snippets/doc_${name}.actual
    -DDATA_DIR=${data_dir} -P ${ATTEND_DOC_SNIPPETS_SCRIPT})
  set_tests_properties(doc.${name} PROPERTIES LABELS docs)
endfunction()
