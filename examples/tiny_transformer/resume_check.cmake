# SPDX-License-Identifier: Apache-2.0
# ctest example_tiny_transformer_resume: a run saved at step 40 on 2 ranks and resumed to step 80 goes on as one run.
#   cmake -DEXE=<tiny_transformer> -DTOOL=<tandem_checkpoint> -DDIR=<scratch directory> -P resume_check.cmake
# - resumed on 1 rank under another policy, it ends at the final loss of an uninterrupted 80-step run on 1 rank
#   (within 1e-5 relative: the first 40 steps were reduced over 2 ranks);
# - resumed on 2 ranks under the policy that saved it, its trained parameters are bitwise those of an uninterrupted
#   80-step run on 2 ranks (the same fingerprint);
# - its save at step 80 replaces the step-40 checkpoint in the same directory; tandem_checkpoint verifies the result and
#   consolidates it, imports the consolidated file as a parameters-only checkpoint, verifies that, and consolidates it
#   again to the same tensors;
# - a resume with options that would not continue the saved run (another seed, training set or learning rate: the
#   checkpoint's metadata records them), in another dtype, from no checkpoint, or not past its step, is refused before
#   it trains; one from the imported parameters is not;
# - a --save of another model over it is refused before training, and leaves it whole.
cmake_minimum_required(VERSION 3.25)
foreach(var IN ITEMS EXE TOOL DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "resume_check.cmake: -D${var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE "${DIR}")
file(MAKE_DIRECTORY "${DIR}")
set(common --backend host --eval 256)

function(run name)
  execute_process(COMMAND "${EXE}" ${common} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${name}: tiny_transformer ${ARGN} failed (${rc}):\n${out}")
  endif()
  string(REGEX MATCH "fingerprint ([0-9a-f]+)" _ "${out}")
  set(${name}_fingerprint "${CMAKE_MATCH_1}" PARENT_SCOPE)
  set(${name}_out "${out}" PARENT_SCOPE)
endfunction()

# The final loss (the CSV's 10th column) of a one-row CSV.
function(final_loss csv var)
  file(STRINGS "${csv}" lines)
  list(GET lines 1 row)
  string(REPLACE "," ";" fields "${row}")
  list(GET fields 9 loss)
  set(${var} "${loss}" PARENT_SCOPE)
endfunction()

run(saved --ranks 2 --steps 40 --policy gradient-sharded --save "${DIR}/ckpt")
# A run that would not continue the saved one (another seed: another order of the batches; another training set) is
# refused before it trains (from the checkpoint's manifest), naming what differs.
foreach(other IN ITEMS "--seed;2" "--train-examples;40000" "--lr;0.001")
  execute_process(COMMAND "${EXE}" ${common} --ranks 2 --steps 80 ${other} --resume "${DIR}/ckpt"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  list(GET other 0 option)
  if(option STREQUAL "--train-examples")
    set(option "training set")
  endif()
  if(NOT rc EQUAL 2 OR NOT out MATCHES "is of a run this one would not continue:\n  ${option}: " OR
     out MATCHES "\ntraining:")
    message(FATAL_ERROR "--resume with ${other}: not refused before training (${rc}):\n${out}")
  endif()
endforeach()
# So are a run in the other dtype, naming the flag to change, a directory without a checkpoint, and a run that would
# not train past the checkpoint's step, each with exit code 2.
set(ckpt "${DIR}/ckpt")
foreach(case IN ITEMS "80;${ckpt};--bf16;holds fp32 parameters, and this run trains bf16 ones: resume it without --bf16"
                      "80;${DIR};--resume: tandem: the checkpoint `[^`]*` has no manifest.json: it is not a checkpoint"
                      "40;${ckpt};is at step 40, which --steps 40 does not go past: nothing to train")
  list(POP_BACK case expected)
  list(POP_FRONT case steps from)
  execute_process(COMMAND "${EXE}" ${common} --ranks 2 --steps ${steps} --resume "${from}" ${case}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 2 OR NOT out MATCHES "${expected}" OR out MATCHES "\ntraining:")
    message(FATAL_ERROR "--steps ${steps} --resume ${from} ${case}: not refused before training (${rc}):\n${out}")
  endif()
endforeach()
run(resumed_1 --ranks 1 --steps 80 --policy replicated --resume "${DIR}/ckpt" --csv "${DIR}/resumed.csv")
run(straight_1 --ranks 1 --steps 80 --policy replicated --csv "${DIR}/straight.csv")
final_loss("${DIR}/resumed.csv" resumed)
final_loss("${DIR}/straight.csv" straight)
# |resumed - straight| <= 1e-5 * straight, in fixed point with 9 decimals (CMake's math is integer-only)
string(REGEX REPLACE "^([0-9]+)\\.([0-9]*)$" "\\1;\\2" a "${resumed}")
string(REGEX REPLACE "^([0-9]+)\\.([0-9]*)$" "\\1;\\2" b "${straight}")
foreach(v IN ITEMS a b)
  list(GET ${v} 0 whole)
  list(GET ${v} 1 frac)
  string(SUBSTRING "${frac}000000000" 0 9 frac)
  string(REGEX REPLACE "^0+([0-9])" "\\1" frac "${frac}")
  math(EXPR ${v}_fixed "${whole} * 1000000000 + ${frac}")
endforeach()
math(EXPR diff "${a_fixed} - ${b_fixed}")
if(diff LESS 0)
  math(EXPR diff "-(${diff})")
endif()
math(EXPR bound "${b_fixed} / 100000")  # 1e-5 relative
if(diff GREATER bound)
  message(FATAL_ERROR "resumed on 1 rank: final loss ${resumed}, an uninterrupted run: ${straight} (more than 1e-5 "
                      "relative apart)\n${resumed_1_out}")
endif()

run(resumed_2 --ranks 2 --steps 80 --policy gradient-sharded --resume "${DIR}/ckpt" --save "${DIR}/ckpt")
run(straight_2 --ranks 2 --steps 80 --policy gradient-sharded)
if(NOT resumed_2_fingerprint STREQUAL straight_2_fingerprint OR resumed_2_fingerprint STREQUAL "")
  message(FATAL_ERROR "resumed on 2 ranks: fingerprint ${resumed_2_fingerprint}; an uninterrupted run: "
                      "${straight_2_fingerprint} (they must be equal)")
endif()

# tandem_checkpoint ARGN; fails the check unless it succeeds and its output matches `expect`.
function(tool expect)
  execute_process(COMMAND "${TOOL}" ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "${expect}")
    message(FATAL_ERROR "tandem_checkpoint ${ARGN} (${rc}):\n${out}")
  endif()
endfunction()

# (the options a load restores, then the program's metadata)
string(CONCAT verified "step 80, saved by GradientSharded at 2 ranks.*\n"
       "  AdamW options: lr [0-9.e-]+ beta1 0.9 beta2 0.999 eps 1e-08 weight_decay 0\n"
       ".*  metadata \"--seed\": \"1\"\n")
tool("${verified}" verify "${DIR}/ckpt")
tool("" consolidate "${DIR}/ckpt" "${DIR}/model.safetensors")
# The consolidated parameters imported as a parameters-only checkpoint: it verifies, and consolidated again it holds
# the same tensors, each with the same data checksum (the headers' metadata name their source, so the files differ).
tool("" import "${DIR}/model.safetensors" "${DIR}/imported")
tool("step 0, .*\\(parameters only\\).*verified" verify "${DIR}/imported")
# Imported parameters record no run: a run with other options starts from them.
run(from_imported --ranks 2 --steps 4 --seed 2 --resume "${DIR}/imported")
tool("" consolidate "${DIR}/imported" "${DIR}/again.safetensors")
foreach(f IN ITEMS model again)
  file(READ "${DIR}/${f}.safetensors" header OFFSET 8 LIMIT 65536)  # (the JSON header, past its 8-byte length)
  string(REGEX MATCH "\"crc32c\":\"([0-9a-f]+)\"" _ "${header}")
  set(${f}_crcs "${CMAKE_MATCH_1}")
  string(REGEX MATCHALL "\"data_offsets\"" entries "${header}")
  list(LENGTH entries ${f}_tensors)
endforeach()
if(model_crcs STREQUAL "" OR NOT model_crcs STREQUAL again_crcs OR NOT model_tensors EQUAL again_tensors)
  message(FATAL_ERROR "imported and consolidated again: ${again_tensors} tensors, checksums ${again_crcs}; the "
                      "consolidated checkpoint: ${model_tensors}, ${model_crcs}")
endif()
# A --save over the checkpoint of another model (narrower) is refused before it trains, and the checkpoint stays whole.
execute_process(COMMAND "${EXE}" ${common} --ranks 2 --steps 4 --width 32 --save "${DIR}/ckpt" RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(rc EQUAL 0 OR NOT out MATCHES "holds the checkpoint of other tensors" OR out MATCHES ": step 1/")
  message(FATAL_ERROR "--save over another model's checkpoint: not refused before training (${rc}):\n${out}")
endif()
tool("step 80, saved by GradientSharded at 2 ranks" verify "${DIR}/ckpt")
message(STATUS "resumed on 1 rank: final loss ${resumed} (uninterrupted: ${straight}); on 2 ranks: fingerprint "
               "${resumed_2_fingerprint}, as uninterrupted")
file(REMOVE_RECURSE "${DIR}")
