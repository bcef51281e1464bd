# Installs the built stepguard into a scratch prefix, then configures, builds and runs the consumer
# project against that install tree only: CMAKE_PREFIX_PATH names the prefix and nothing else (the
# package finds the LibTorch it was built against by itself, from the hint it recorded). Run with
# cmake -P (see integration/tests/CMakeLists.txt).
foreach(var SOURCE_DIR BUILD_DIR WORK_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_consumer_test.cmake: ${var} is not set")
  endif()
endforeach()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/install)

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer test: ${what} failed (${rc})\n${out}\n${err}")
  endif()
  message(STATUS "consumer test: ${what}: ok")
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

run_step("install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
# The installed CLI starts from the prefix alone (its RUNPATH names the installed library and the
# torch it was built against), with no library path from the environment.
run_step("installed CLI" ${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH
         ${prefix}/bin/stepguard --version)
if(NOT last_output MATCHES "^stepguard [0-9]")
  message(FATAL_ERROR "consumer test: unexpected 'stepguard --version' output:\n${last_output}")
endif()
set(generator_args)
if(CMAKE_GENERATOR)
  set(generator_args -G "${CMAKE_GENERATOR}")
endif()
run_step("configure" ${CMAKE_COMMAND} -S ${SOURCE_DIR}/integration/cmake_consumer
         -B ${WORK_DIR}/build ${generator_args} -DCMAKE_BUILD_TYPE=Release
         -DCMAKE_PREFIX_PATH=${prefix})
run_step("build" ${CMAKE_COMMAND} --build ${WORK_DIR}/build -j2)
run_step("run" ${WORK_DIR}/build/consumer)
message(STATUS "${last_output}")
if(NOT last_output MATCHES "step 2 skipped")
  message(FATAL_ERROR "consumer test: expected 'step 2 skipped' in:\n${last_output}")
endif()

# The package ties its consumer to no torch of this build. The exported targets name torch by
# name only (stepguard::torch, the consumer's) and the installed library's RUNPATH names no torch
# folder; a consumer pointed at another torch (here this torch seen through a tree of links
# elsewhere, as another install of the same release) links and runs with that one alone.
file(STRINGS ${BUILD_DIR}/CMakeCache.txt torch_dir_line REGEX "^Torch_DIR:")
string(REGEX REPLACE "^Torch_DIR:[A-Z]+=" "" build_torch_dir "${torch_dir_line}")
get_filename_component(build_torch "${build_torch_dir}/../../.." ABSOLUTE)
file(GLOB targets_files ${prefix}/lib*/cmake/stepguard/stepguard-targets*.cmake)
foreach(f IN LISTS targets_files)
  file(READ ${f} text)
  string(FIND "${text}" "${build_torch}" at)
  if(NOT at EQUAL -1)
    message(FATAL_ERROR "consumer test: ${f} names the build's torch (${build_torch})")
  endif()
endforeach()
file(GLOB library ${prefix}/lib*/libstepguard.so.0)
run_step("library RUNPATH" readelf -d ${library})
string(FIND "${last_output}" "${build_torch}" at)
if(NOT at EQUAL -1)
  message(FATAL_ERROR "consumer test: the installed library's RUNPATH names the build's torch:\n"
          "${last_output}")
endif()
set(other ${WORK_DIR}/other/torch)
file(MAKE_DIRECTORY ${WORK_DIR}/other)
run_step("another torch" cp -rs ${build_torch} ${other})
# The CUDA wheel's libraries find NVIDIA's beside the torch package ($ORIGIN/../../nvidia).
get_filename_component(site ${build_torch} DIRECTORY)
if(EXISTS ${site}/nvidia)
  file(CREATE_LINK ${site}/nvidia ${WORK_DIR}/other/nvidia SYMBOLIC)
endif()
run_step("configure against another torch" ${CMAKE_COMMAND}
         -S ${SOURCE_DIR}/integration/cmake_consumer -B ${WORK_DIR}/build_other ${generator_args} -DCMAKE_BUILD_TYPE=Release
         -DCMAKE_PREFIX_PATH=${prefix} -DTorch_DIR=${other}/share/cmake/Torch)
run_step("build against another torch" ${CMAKE_COMMAND} --build ${WORK_DIR}/build_other -j2)
file(GLOB_RECURSE link_files ${WORK_DIR}/build_other/link.txt ${WORK_DIR}/build_other/build.ninja)
set(link_text "")
foreach(f IN LISTS link_files)
  file(READ ${f} text)
  string(APPEND link_text "${text}")
endforeach()
string(FIND "${link_text}" "${other}/lib/libc10.so" other_at)
string(FIND "${link_text}" "${build_torch}/lib" build_at)
if(other_at EQUAL -1 OR NOT build_at EQUAL -1)
  message(FATAL_ERROR "consumer test: the consumer built against ${other} links:\n${link_text}")
endif()
run_step("run against another torch" ${WORK_DIR}/build_other/consumer)
if(NOT last_output MATCHES "step 2 skipped")
  message(FATAL_ERROR "consumer test: expected 'step 2 skipped' in:\n${last_output}")
endif()
