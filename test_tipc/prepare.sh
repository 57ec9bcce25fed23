#!/bin/bash
# Prepares what test_train_inference_python.sh needs for one mode, with no downloads:
# checks the Python packages (installing requirements.txt if one is missing), builds
# the psa_mask op, and puts the data in test_tipc/data/cityscapes.
#
#   bash test_tipc/prepare.sh test_tipc/configs/psanet/train_infer_python.txt lite_train_lite_infer
#
# lite_train_lite_infer    generated mini Cityscapes, 4 train + 2 val images of 128x64
# lite_train_whole_infer   the same with 10 val images
# whole_train_whole_infer  the real Cityscapes, which you place there yourself
# whole_infer              trained weights at the txt's infer_model path + the val images
source test_tipc/common_func.sh

set -o errexit
set -o nounset

FILENAME=$1
MODE=$2
MODES="lite_train_lite_infer lite_train_whole_infer whole_train_whole_infer whole_infer"
if [[ " ${MODES} " != *" ${MODE} "* ]]; then
    echo "unknown mode '${MODE}'; one of: ${MODES}" >&2
    exit 2
fi

dataline=$(cat ${FILENAME})
IFS=$'\n'
lines=(${dataline})
model_name=$(func_parser_value "${lines[1]}")
python=$(func_parser_value "${lines[2]}")
infer_model=$(func_parser_value "${lines[36]}")
IFS=$' \t\n'

DATA=test_tipc/data/cityscapes
mkdir -p test_tipc/data

function make_mini(){
    # Replaces an earlier mini Cityscapes; refuses to overwrite any other dataset.
    ${python} tools/make_mini_cityscapes.py --out ${DATA} --num_train $1 --num_val $2 \
        --size 128 64 --seed 0 > /dev/null
    echo "mini Cityscapes ($1 train, $2 val, 128x64) in ${DATA}"
}

function need_real_cityscapes(){
    if [ ! -d ${DATA}/leftImg8bit ] || [ -f ${DATA}/mini_cityscapes.json ]; then
        echo "${MODE} needs the real Cityscapes in ${DATA} (leftImg8bit/ and gtFine/ from" \
             "cityscapes-dataset.com, e.g. a symlink: ln -s /path/to/cityscapes ${DATA})," \
             "then: ${python} tools/prepare_cityscapes.py --root ${DATA}" >&2
        exit 1
    fi
}

# What the mode needs from you first, before anything is installed or built.
if [ ${MODE} = "whole_train_whole_infer" ]; then
    need_real_cityscapes
elif [ ${MODE} = "whole_infer" ] && [ ! -f ${infer_model} ]; then
    echo "whole_infer needs trained weights at ${infer_model}: train first (e.g." \
         "lite_train_lite_infer, then cp test_tipc/output/${model_name}/norm_train_gpus_-1_autocast_null/best_model/model.pdparams ${infer_model})." >&2
    exit 1
fi

# Packages: Paddle is installed by hand (CPU or GPU build); the rest from requirements.txt.
if ! ${python} -c "import paddle" 2>/dev/null; then
    echo "PaddlePaddle is not installed for '${python}': pip install paddlepaddle==3.3.1" \
         "(or paddlepaddle-gpu), then run this again." >&2
    exit 1
fi
if ! ${python} -c "import paddleseg, cv2, yaml, cityscapesscripts" 2>/dev/null; then
    ${python} -m pip install -r requirements.txt
fi

# The op: built once into its cache (about 15 s), so that no timed step pays for it.
${python} -c "from psanet.ops import load_library; print('psa_mask op:', load_library())"

if [ ${MODE} = "lite_train_lite_infer" ]; then
    make_mini 4 2
elif [ ${MODE} = "lite_train_whole_infer" ]; then
    make_mini 4 10
elif [ ${MODE} = "whole_train_whole_infer" ]; then
    ${python} tools/prepare_cityscapes.py --root ${DATA}
elif [ ${MODE} = "whole_infer" ] && [ ! -d ${DATA}/leftImg8bit/val ]; then
    make_mini 4 10
fi
echo "prepared ${MODE} for ${model_name}"
