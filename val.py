"""Evaluate a trained model on the config's val_dataset (PaddleSeg's val.py flags).

    python val.py --config configs/psanet/psanet_resnet50_os8_cityscapes_1024x512_80k.yml \
        --model_path output/best_model/model.pdparams
    python val.py ... --save_dir output/results   # + Cityscapes *_labelIds.png for the official
    CITYSCAPES_DATASET=data/cityscapes CITYSCAPES_RESULTS=output/results \
        python tools/evaluate_cityscapes.py
"""
import argparse

from psanet.cli import add_inference_flags, add_model_flags, exit_with, run_cli
from psanet.core.options import AMP_LEVELS, DEFAULT_DEVICE, DYGRAPH_PRECISIONS


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='PSANet evaluation (PaddleSeg flags).')
    add_model_flags(parser)
    parser.add_argument('--device', choices=['cpu', 'gpu'], default=DEFAULT_DEVICE,
                        help='Default: gpu when Paddle sees one, else cpu.')
    parser.add_argument('--num_workers', type=int, default=0, help='DataLoader worker processes.')
    add_inference_flags(parser, '--aug_eval')
    parser.add_argument('--save_dir', default=None,
                        help='Also write the predictions (Cityscapes *_labelIds.png) and the '
                        'figures class_iou.png and confusion_matrix.png here.')
    parser.add_argument('--precision', choices=DYGRAPH_PRECISIONS, default='fp32',
                        help='fp16: autocast (GPU only).')
    parser.add_argument('--amp_level', choices=AMP_LEVELS, default='O1')
    parser.add_argument('--opts', nargs='+', default=None, help='key=value config overrides.')
    return parser.parse_args(argv)


def main(argv=None):
    options = vars(parse_args(argv))
    # Imported after the flags are parsed: --help and flag errors come before Paddle loads.
    from psanet.core.val import evaluate_from_config
    return run_cli(evaluate_from_config, **options)


if __name__ == '__main__':
    exit_with(main())
