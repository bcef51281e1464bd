# Runs the policy-file fuzzer for a bounded time from a fresh copy of the seed policies (libFuzzer
# adds what it finds to its first corpus folder, so the sources stay untouched).
file(REMOVE_RECURSE ${WORKDIR})
file(MAKE_DIRECTORY ${WORKDIR})
file(GLOB seeds ${SEEDS}/*.yaml ${EXTRA_SEEDS}/*.yaml)
file(COPY ${seeds} DESTINATION ${WORKDIR})
execute_process(
  COMMAND ${FUZZER} -max_total_time=30 -timeout=10 -rss_limit_mb=2048 -seed=1
          -print_final_stats=1 -artifact_prefix=${WORKDIR}/ ${WORKDIR}
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the policy-file fuzzer found a failing input (exit ${rc}); see above")
endif()
