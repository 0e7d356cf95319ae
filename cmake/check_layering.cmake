cmake_minimum_required(VERSION 3.25)
# Checks the daemon's layering (cmake -DROOT=<repository> -P check_layering.cmake), run by the
# sparsecar_layering target on every build: a part of daemon/ may include only itself and the parts
# below it, and nothing outside daemon/ may include the daemon. Lowest first:
#
#   transport   wire format, authentication, rendezvous, UCX
#   config      the knob table and configuration (reads the job secret: transport/auth.h)
#   metrics     Prometheus families (transport/transport.h for the link sample size)
#   device      what trainers lend on their GPUs (CUDA IPC mappings, events): DeviceRuntime;
#               sees only pipeline/step.h (DeviceBuffer)
#   session     the trainers' socket and shared memory; hands steps to the pipeline through the
#               interface in pipeline/step.h (that one header only); opens device tensors
#               through device/
#   collective  mailbox and the exchange of one step
#   pipeline    compression, decisions, observations, the job agreement, checkpoints
#   control     the control socket and its commands
#   daemon.cc, main.cc, ctl_main.cc wire everything.
set(allowed_transport "")
set(allowed_config transport)
set(allowed_metrics transport)
set(allowed_device "")
set(allowed_session device)
set(allowed_collective transport metrics)
set(allowed_pipeline transport config metrics collective device)
set(allowed_control transport config metrics collective pipeline session device)
set(allowed_files_device pipeline/step.h)
set(allowed_files_session pipeline/step.h)

set(problems "")
foreach(part transport config metrics device session collective pipeline control)
  file(GLOB sources ${ROOT}/daemon/${part}/*.h ${ROOT}/daemon/${part}/*.cc)
  foreach(source ${sources})
    file(STRINGS ${source} includes REGEX "^#include \"daemon/")
    foreach(line ${includes})
      string(REGEX MATCH "\"daemon/([a-z_]+)/([^\"]+)\"" _ "${line}")
      set(other ${CMAKE_MATCH_1})
      set(file ${CMAKE_MATCH_1}/${CMAKE_MATCH_2})
      if(other STREQUAL part OR other IN_LIST allowed_${part} OR file IN_LIST allowed_files_${part})
        continue()
      endif()
      file(RELATIVE_PATH where ${ROOT} ${source})
      string(APPEND problems "\n  ${where}: ${part} must not include ${file} (${part} sits below ${other})")
    endforeach()
  endforeach()
endforeach()

foreach(outside kernels policies common client)
  file(GLOB_RECURSE sources ${ROOT}/${outside}/*.h ${ROOT}/${outside}/*.cc)
  foreach(source ${sources})
    file(STRINGS ${source} includes REGEX "^#include \"daemon/")
    if(includes)
      file(RELATIVE_PATH where ${ROOT} ${source})
      string(APPEND problems "\n  ${where}: ${outside}/ must not include the daemon (${includes})")
    endif()
  endforeach()
endforeach()

if(problems)
  message(FATAL_ERROR "wrong-way includes (see cmake/check_layering.cmake):${problems}")
endif()
