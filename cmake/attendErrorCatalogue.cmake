# SPDX-License-Identifier: MIT
# Keeps docs/errors.md, the headers and the tests in step (ctest label `catalogue`):
#   cmake -DSOURCE_DIR=<attend source dir> -P cmake/attendErrorCatalogue.cmake
# Fails, naming every offending id and where it is missing, when an error id a header throws
# ("attend.<kind>.<rule>" as a string literal under include/) has no `### attend.<kind>.<rule>` entry in
# docs/errors.md or appears in no file under tests/, or when docs/errors.md has an entry no header throws.
cmake_minimum_required(VERSION 3.16)
if(NOT SOURCE_DIR)
  message(FATAL_ERROR "usage: cmake -DSOURCE_DIR=<attend source dir> -P attendErrorCatalogue.cmake")
endif()

set(id_literal "\"attend\\.[a-z_]+\\.[a-z_]+\"")

# The ids quoted as string literals in ${file} (relative to SOURCE_DIR), into ${out}.
function(attend_quoted_ids file out)
  set(ids)
  file(STRINGS ${SOURCE_DIR}/${file} lines REGEX "${id_literal}")
  foreach(line IN LISTS lines)
    string(REGEX MATCHALL "${id_literal}" literals "${line}")
    foreach(literal IN LISTS literals)
      string(REPLACE "\"" "" id "${literal}")
      list(APPEND ids ${id})
    endforeach()
  endforeach()
  set(${out} ${ids} PARENT_SCOPE)
endfunction()

# id -> the headers that throw it, as attend_where_<id>.
file(GLOB_RECURSE headers RELATIVE ${SOURCE_DIR} ${SOURCE_DIR}/include/*.hpp)
list(SORT headers)
set(thrown)
foreach(header IN LISTS headers)
  attend_quoted_ids(${header} ids)
  foreach(id IN LISTS ids)
    list(APPEND thrown ${id})
    list(APPEND attend_where_${id} ${header})
  endforeach()
endforeach()
list(REMOVE_DUPLICATES thrown)
list(SORT thrown)

set(catalogue_path docs/errors.md)
if(NOT EXISTS ${SOURCE_DIR}/${catalogue_path})
  message(FATAL_ERROR "${catalogue_path} is missing; it must have a `### <id>` entry for each of: ${thrown}")
endif()
file(STRINGS ${SOURCE_DIR}/${catalogue_path} headings REGEX "^### `?attend\\.[a-z_]+\\.[a-z_]+`?")
set(documented)
foreach(heading IN LISTS headings)
  string(REGEX MATCH "attend\\.[a-z_]+\\.[a-z_]+" id "${heading}")
  list(APPEND documented ${id})
endforeach()

# Every file under tests/ read once; an id counts as tested when its quoted literal appears in one of them.
file(GLOB_RECURSE test_files RELATIVE ${SOURCE_DIR} ${SOURCE_DIR}/tests/*.cpp ${SOURCE_DIR}/tests/*.hpp)
set(tested)
foreach(test_file IN LISTS test_files)
  attend_quoted_ids(${test_file} ids)
  list(APPEND tested ${ids})
endforeach()

set(problems)
foreach(id IN LISTS thrown)
  list(REMOVE_DUPLICATES attend_where_${id})
  string(REPLACE ";" ", " where "${attend_where_${id}}")
  if(NOT id IN_LIST documented)
    list(APPEND problems "${id} (thrown in ${where}) has no `### ${id}` entry in ${catalogue_path}")
  endif()
  if(NOT id IN_LIST tested)
    list(APPEND problems "${id} (thrown in ${where}) appears in no test: no file under tests/ contains \"${id}\"")
  endif()
endforeach()
foreach(id IN LISTS documented)
  if(NOT id IN_LIST thrown)
    list(APPEND problems "${id} is listed in ${catalogue_path} but no header under include/ throws it")
  endif()
endforeach()

list(LENGTH thrown thrown_count)
if(problems)
  list(LENGTH problems problem_count)
  string(REPLACE ";" "\n  " text "${problems}")
  message(FATAL_ERROR "error catalogue: ${problem_count} problem(s) among ${thrown_count} ids:\n  ${text}")
endif()
message(STATUS "error catalogue: all ${thrown_count} ids are documented in ${catalogue_path} and tested")
