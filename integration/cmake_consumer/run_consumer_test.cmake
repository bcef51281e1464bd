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
