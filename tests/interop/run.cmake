# SPDX-License-Identifier: Apache-2.0
# ctest checkpoint_safetensors: the tiny transformer saves a checkpoint on 2 ranks, tandem_checkpoint consolidates it
# with every array, and check_safetensors.py opens the shards and the consolidated file with Hugging Face's safetensors.
#   cmake -DEXE=<tiny_transformer> -DTOOL=<tandem_checkpoint> -DPYTHON=<python3> -DDIR=<scratch> -P run.cmake
# Where safetensors is not installed for PYTHON it prints "skipped: safetensors is not installed", which the test's
# SKIP_REGULAR_EXPRESSION reports as skipped (never passed).
cmake_minimum_required(VERSION 3.25)
file(REMOVE_RECURSE "${DIR}")
foreach(step IN ITEMS save consolidate check)
  if(step STREQUAL "save")
    set(cmd "${EXE}" --backend host --ranks 2 --steps 3 --eval 64 --policy optimizer-sharded --save "${DIR}/ckpt")
  elseif(step STREQUAL "consolidate")
    set(cmd "${TOOL}" consolidate "${DIR}/ckpt" "${DIR}/all.safetensors" --all)
  else()
    set(cmd "${PYTHON}" "${CMAKE_CURRENT_LIST_DIR}/check_safetensors.py" "${DIR}/ckpt" "${DIR}/all.safetensors")
  endif()
  execute_process(COMMAND ${cmd} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  message("${out}")
  if(step STREQUAL "check" AND rc EQUAL 77)
    file(REMOVE_RECURSE "${DIR}")
    message(FATAL_ERROR "checkpoint_safetensors: skipped: safetensors is not installed for ${PYTHON}")
  endif()
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${step} failed (${rc})")
  endif()
endforeach()
file(REMOVE_RECURSE "${DIR}")
