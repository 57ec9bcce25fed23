#!/usr/bin/env bash
# README's Quick start: set up, then the main job on the built-in mini Cityscapes, on the CPU:
# generate data -> train PSANet (small config) -> evaluate with --aug_eval --flip_horizontal
# -> predict a few images -> export -> run the exported model with Paddle Inference
# -> draw the attention of a few pixels. ITERS=N trains N iterations instead of the config's 100
# (CI's run on the oldest stack: the same code, a shorter run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. "${VENV:-.venv}/bin/activate"

CONFIG=${CONFIG:-configs/psanet/psanet_resnet18_os8_mini_cityscapes_128x64_100.yml}
DATA=data/mini_cityscapes
OUT=${OUT:-output/quickstart}
VAL_IMAGES=$DATA/leftImg8bit/val

step() { printf '\n=== %s ===\n' "$*"; }

step "1/7 generate the mini Cityscapes in $DATA"
python tools/make_mini_cityscapes.py --out "$DATA" --num_train 40 --num_val 10 --seed 0

step "2/7 train ($CONFIG; --overwrite: a rerun starts this demo run over)"
python train.py --config "$CONFIG" --device cpu --save_dir "$OUT/train" --do_eval \
    --save_interval 100 --log_iters 10 --seed 0 --keep_checkpoint_max 1 --overwrite \
    ${ITERS:+--iters "$ITERS"}

MODEL=$OUT/train/best_model/model.pdparams
step "3/7 evaluate with --aug_eval --flip_horizontal"
python val.py --config "$CONFIG" --model_path "$MODEL" --device cpu --aug_eval --flip_horizontal \
    --save_dir "$OUT/val_labelIds" | tee "$OUT/val.txt"

step "4/7 predict the val images"
python predict.py --config "$CONFIG" --model_path "$MODEL" --device cpu --image_path "$VAL_IMAGES" \
    --save_dir "$OUT/predict"

step "5/7 export (dynamic input shape) and compare with the dynamic model"
python export.py --config "$CONFIG" --model_path "$MODEL" --save_dir "$OUT/inference_model" \
    --check_image_path "$VAL_IMAGES"

step "6/7 run the exported model with Paddle Inference"
python deploy/python/infer.py --config "$OUT/inference_model/deploy.yaml" --image_path "$VAL_IMAGES" \
    --device cpu --save_dir "$OUT/infer"

step "7/7 draw where four pixels collect from and distribute to"
python tools/visualize_attention.py --config "$CONFIG" --model_path "$MODEL" --device cpu \
    --image_path "$VAL_IMAGES/frankfurt/frankfurt_000000_000019_leftImg8bit.png" \
    --points 40,100 128,64 0,0 250,20 --save_dir "$OUT/attention"

cat <<MSG

Quick start done. Results:
  training log and checkpoints   $OUT/train/ (best model: $MODEL)
  evaluation (mIoU, per class)   $OUT/val.txt, drawn in $OUT/val_labelIds/class_iou.png and confusion_matrix.png
  Cityscapes *_labelIds.png      $OUT/val_labelIds/
  predictions and overlays       $OUT/predict/pseudo_color_prediction/, $OUT/predict/added_prediction/
  exported model                 $OUT/inference_model/ (model.json, model.pdiparams, deploy.yaml)
  Paddle Inference outputs       $OUT/infer/
  attention of four pixels       $OUT/attention/ (one PNG per pixel, and a sheet of all)

In a new shell, first activate the environment (else: No module named 'paddle'):
  . ${VENV:-.venv}/bin/activate
then run the commands of README.md from this folder; \`from psanet import Segmenter\` works
from any folder (psanet is installed editable).
MSG
