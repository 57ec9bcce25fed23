#!/usr/bin/env bash
# What a refactoring must not change, written to one text file to diff before and after:
# the Quick start's loss lines, evaluation figures, the sha256 of every checkpoint, prediction,
# export, Paddle Inference and attention file it writes, and the messages and exit codes of
# bad flags. Usage: bash scripts/behaviour_snapshot.sh OUT_DIR  (writes OUT_DIR/snapshot.txt)
# Needs the environment of scripts/setup_env.sh; the mini dataset is generated into OUT_DIR.
# SUMMARY_ONLY=1 writes snapshot.txt again from the files an earlier run left in OUT_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:?usage: behaviour_snapshot.sh OUT_DIR}")
PY=${PYTHON:-.venv/bin/python}
CONFIG=configs/psanet/psanet_resnet18_os8_mini_cityscapes_128x64_100.yml
DATA=$OUT/mini_cityscapes
VAL_IMAGES=$DATA/leftImg8bit/val
MODEL=$OUT/train/best_model/model.pdparams
SNAP=$OUT/snapshot.txt
OPTS=(--opts "train_dataset.dataset_root=$DATA" "val_dataset.dataset_root=$DATA")

if [ -z "${SUMMARY_ONLY:-}" ]; then
rm -rf "$OUT" && mkdir -p "$OUT"

$PY tools/make_mini_cityscapes.py --out "$DATA" --num_train 40 --num_val 10 --seed 0 > "$OUT/make.txt"
$PY train.py --config "$CONFIG" --device cpu --save_dir "$OUT/train" --do_eval --save_interval 100 \
    --log_iters 10 --seed 0 --keep_checkpoint_max 1 "${OPTS[@]}" > "$OUT/train.txt" 2>&1
$PY val.py --config "$CONFIG" --model_path "$MODEL" --device cpu --aug_eval --flip_horizontal \
    --save_dir "$OUT/val_labelIds" "${OPTS[@]}" > "$OUT/val.txt" 2>&1
$PY predict.py --config "$CONFIG" --model_path "$MODEL" --device cpu --image_path "$VAL_IMAGES" \
    --save_dir "$OUT/predict" "${OPTS[@]}" > "$OUT/predict.txt" 2>&1
$PY export.py --config "$CONFIG" --model_path "$MODEL" --save_dir "$OUT/inference_model" \
    --check_image_path "$VAL_IMAGES" "${OPTS[@]}" > "$OUT/export.txt" 2>&1
$PY deploy/python/infer.py --config "$OUT/inference_model/deploy.yaml" --image_path "$VAL_IMAGES" \
    --device cpu --save_dir "$OUT/infer" > "$OUT/infer.txt" 2>&1
$PY tools/visualize_attention.py --config "$CONFIG" --model_path "$MODEL" --device cpu \
    --image_path "$VAL_IMAGES/frankfurt/frankfurt_000000_000019_leftImg8bit.png" \
    --points 40,100 128,64 0,0 250,20 --save_dir "$OUT/attention" "${OPTS[@]}" > "$OUT/attention.txt" 2>&1
fi

{
    echo "## loss lines (train.log, timings cut)"
    grep -o 'iter: [0-9]*/[0-9]*, loss: .*, lr: [0-9.e-]*' "$OUT/train/train.log"
    echo "## evaluation lines"
    grep -h -E 'mIoU|Acc|Kappa' "$OUT/train/train.log" "$OUT/val.txt" | sed 's/^.*\] //' | sed 's/^[0-9-]* [0-9:,]* //'
    echo "## files written (sha256, path); logs, timings and the export's own report left out"
    (cd "$OUT" && find train/iter_* train/best_model val_labelIds predict inference_model infer attention -type f \
        ! -name '*.log' ! -name 'train_state.json' ! -name '*.lock' | LC_ALL=C sort | xargs sha256sum)
    echo "## bad flags (exit code, stderr's last line)"
    bad() {
        local rc=0 err
        err=$("$PY" "$@" 2>&1 >/dev/null) || rc=$?
        echo "$* -> $rc: $(printf '%s\n' "$err" | tail -n 1)" | sed "s#$OUT#OUT#g; s#$PWD#REPO#g"
    }
    bad train.py --config missing.yml
    bad train.py --config "$CONFIG" --iters 0
    bad train.py --config "$CONFIG" --batch_size -2
    bad train.py --config "$CONFIG" --save_dir "$OUT/train" "${OPTS[@]}"
    bad train.py --config "$CONFIG" --resume_model auto --overwrite --save_dir "$OUT/x"
    bad train.py --config "$CONFIG" --precision fp8
    bad val.py --config "$CONFIG" --model_path "$OUT/nothing.pdparams"
    bad val.py --config "$CONFIG" --model_path "$MODEL" --scales 0
    bad val.py --config "$CONFIG" --model_path "$MODEL" --is_slide --crop_size 10
    bad predict.py --config "$CONFIG" --model_path "$MODEL" --image_path "$OUT/none.png"
    bad predict.py --config "$CONFIG" --model_path "$MODEL" --image_path "$VAL_IMAGES" --scales 0.5
    bad export.py --config "$CONFIG" --model_path "$MODEL" --save_dir "$OUT/e" --calib_images "$VAL_IMAGES"
    bad export.py --config "$CONFIG" --model_path "$MODEL" --save_dir "$OUT/e" --input_shape 1 3 x
    bad export.py --config "$CONFIG" --model_path "$MODEL" --save_dir "$OUT/e" --output_op max
    bad export.py --config "$CONFIG" --model_path "$MODEL" --save_dir "$OUT/e" --quantize int8
    bad deploy/python/infer.py --config "$OUT/missing/deploy.yaml" --image_path "$VAL_IMAGES"
    bad deploy/python/infer.py --config "$OUT/inference_model/deploy.yaml" --image_path "$VAL_IMAGES" --cpu_threads 0
    bad deploy/python/infer.py --config "$OUT/inference_model/deploy.yaml" --image_path "$VAL_IMAGES" --backend tensorrt
    bad deploy/python/infer.py --config "$OUT/inference_model/deploy.yaml" --image_path "$VAL_IMAGES" --precision int4
    bad tools/visualize_attention.py --config "$CONFIG" --model_path "$MODEL" --image_path "$VAL_IMAGES" --points 1,2,3
} > "$SNAP"
echo "wrote $SNAP"
