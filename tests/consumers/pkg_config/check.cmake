# SPDX-License-Identifier: MIT
# Builds tests/consumers/consumer.cpp as a project without CMake does: the compiler plus `pkg-config --cflags
# --libs attend`, and runs it.
#   cmake -DPKG_CONFIG=<pkg-config> -DCXX=<compiler> -DSOURCE=<consumer.cpp> -DWORK=<scratch dir>
#         -DPREFIXES=<install prefix>[|<prefix>...] [-DINSTALL_FROM=<configured build tree>] -P check.cmake
# Each prefix is checked alone (PKG_CONFIG_PATH = <prefix>/share/pkgconfig): attend.pc must point into that
# prefix, and the program must build and print "attend consumer: ok". With INSTALL_FROM, the build tree is first
# installed into each prefix with `cmake --install --prefix`, so a prefix other than the configured one (the
# file is generated once, at configure time) proves the file right for any prefix.
cmake_minimum_required(VERSION 3.16)
foreach(var PKG_CONFIG CXX SOURCE WORK PREFIXES)
  if(NOT ${var})
    message(FATAL_ERROR "check.cmake needs -D${var}=...")
  endif()
endforeach()

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err
    OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT result EQUAL 0)
    string(REPLACE ";" " " command "${ARGN}")
    message(FATAL_ERROR "failed (${result}): ${command}\n${out}\n${err}")
  endif()
  set(out "${out}" PARENT_SCOPE)
endfunction()

string(REPLACE "|" ";" PREFIXES "${PREFIXES}")
file(MAKE_DIRECTORY ${WORK})
set(n 0)
foreach(prefix IN LISTS PREFIXES)
  if(INSTALL_FROM)
    run(${CMAKE_COMMAND} --install ${INSTALL_FROM} --prefix ${prefix})
  endif()
  set(pc_dir ${prefix}/share/pkgconfig)
  if(NOT EXISTS ${pc_dir}/attend.pc)
    message(FATAL_ERROR "no attend.pc in ${pc_dir}")
  endif()
  set(ENV{PKG_CONFIG_PATH} ${pc_dir})
  run(${PKG_CONFIG} --modversion attend)
  set(version "${out}")
  run(${PKG_CONFIG} --cflags attend)
  separate_arguments(cflags UNIX_COMMAND "${out}")
  run(${PKG_CONFIG} --libs attend)
  separate_arguments(libs UNIX_COMMAND "${out}")
  # The first -I is attend's own and must be this prefix's include directory.
  set(include_dir "")
  foreach(flag IN LISTS cflags)
    if(flag MATCHES "^-I(.*)" AND NOT include_dir)
      set(include_dir "${CMAKE_MATCH_1}")
    endif()
  endforeach()
  get_filename_component(include_real "${include_dir}" REALPATH)
  get_filename_component(expected_real "${prefix}/include" REALPATH)
  if(NOT include_real STREQUAL expected_real OR NOT EXISTS "${include_real}/attend/attend.hpp")
    message(FATAL_ERROR "pkg-config --cflags attend gives -I${include_dir} (${include_real}), expected ${expected_real}"
      " holding attend/attend.hpp")
  endif()
  set(exe ${WORK}/consumer_${n})
  run(${CXX} -std=c++17 -O0 ${cflags} ${SOURCE} -o ${exe} ${libs})
  run(${exe})
  if(NOT out STREQUAL "attend consumer: ok")
    message(FATAL_ERROR "${exe} printed \"${out}\"")
  endif()
  message(STATUS "attend ${version} from ${prefix} via pkg-config: ${out}")
  math(EXPR n "${n} + 1")
endforeach()
