#!/bin/bash
# Helpers shared by prepare.sh and test_train_inference_python.sh: PaddleSeg's TIPC
# line parsers (`key:value`, `mode1=v1|mode2=v2`) and the per-step status line.

function func_parser_key(){
    strs=$1
    IFS=":"
    array=(${strs})
    tmp=${array[0]}
    echo ${tmp}
}

function func_parser_value(){
    strs=$1
    IFS=":"
    array=(${strs})
    tmp=${array[1]}
    echo ${tmp}
}

# "--key" "value" -> "--key=value"; nothing when the key or the value is null/empty.
function func_set_params(){
    key=$1
    value=$2
    if [ ${key}x = "null"x ];then
        echo " "
    elif [[ ${value} = "null" ]] || [[ ${value} = " " ]] || [ ${#value} -le 0 ];then
        echo " "
    else
        echo "${key}=${value}"
    fi
}

# "key:mode1=v1|mode2=v2" -> the value for $MODE.
function func_parser_params(){
    strs=$1
    IFS=":"
    array=(${strs})
    key=${array[0]}
    tmp=${array[1]}
    IFS="|"
    res=""
    for _params in ${tmp[*]}; do
        IFS="="
        array=(${_params})
        mode=${array[0]}
        value=${array[1]}
        if [[ ${mode} = ${MODE} ]]; then
            IFS="|"
            echo $value
            break
        fi
        IFS="|"
    done
    echo ${res}
}

# One line per step in the status log; failures are counted in TIPC_FAILED so the
# caller can exit non-zero (PaddleSeg's version only logs them).
TIPC_FAILED=${TIPC_FAILED:-0}
function status_check(){
    last_status=$1   # the exit code
    run_command=$2
    run_log=$3
    if [ $last_status -eq 0 ]; then
        message="Run successfully with command - ${run_command}!"
    else
        TIPC_FAILED=$((TIPC_FAILED + 1))
        message="Run failed with command - ${run_command}!"
    fi
    # Coloured on the console, as PaddleSeg's; plain text in the log that people and tools read.
    echo -e "\033[33m ${message}  \033[0m"
    echo "${message}" >> ${run_log}
}
