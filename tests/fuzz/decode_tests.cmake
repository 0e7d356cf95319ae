# Writes the ctest file of the decoder fuzzers (run by the POST_BUILD step of fuzz_decode, see
# CMakeLists.txt): one test fuzz_decode_<format> per row of the codec registry, as listed by
# `fuzz_make_seeds --list`. Inputs (-D): LISTER, FUZZER, SEEDS (checked-in corpora), WORK (where
# new inputs go), SECONDS, OUT.
execute_process(COMMAND ${LISTER} --list OUTPUT_VARIABLE listed RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${LISTER} --list failed (${rc})")
endif()
string(REGEX MATCHALL "[A-Za-z0-9_]+" formats "${listed}")
if(NOT formats)
  message(FATAL_ERROR "${LISTER} --list named no codec")
endif()
math(EXPR timeout "${SECONDS} * 3 + 60")
set(text "# Written by decode_tests.cmake from the codec registry; do not edit.\n")
foreach(format IN LISTS formats)
  set(work ${WORK}/decode_${format})
  file(MAKE_DIRECTORY ${work})
  set(seeds "")
  if(EXISTS ${SEEDS}/decode_${format})
    set(seeds " [==[${SEEDS}/decode_${format}]==]")
  endif()
  string(APPEND text
    "add_test(fuzz_decode_${format} [==[${FUZZER}]==] -max_total_time=${SECONDS} -rss_limit_mb=2048 -timeout=10 "
    "-print_final_stats=1 [==[-artifact_prefix=${work}/]==] [==[${work}]==]${seeds})\n"
    "set_tests_properties(fuzz_decode_${format} PROPERTIES LABELS fuzz TIMEOUT ${timeout} "
    "ENVIRONMENT SPARSECAR_FUZZ_FORMAT=${format})\n")
endforeach()
file(WRITE ${OUT} "${text}")
