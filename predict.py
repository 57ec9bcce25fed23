"""Predict images with a trained model (PaddleSeg's predict.py flags).

    python predict.py --config configs/psanet/psanet_resnet50_os8_cityscapes_1024x512_80k.yml \
        --model_path output/best_model/model.pdparams --image_path demo/ --save_dir output/result
"""
import argparse

from psanet.cli import add_inference_flags, add_model_flags, exit_with, run_cli  # noqa: E402
from psanet.core.options import DEFAULT_DEVICE  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='PSANet prediction (PaddleSeg flags).')
    add_model_flags(parser)
    parser.add_argument('--image_path', required=True,
                        help='An image, a folder of images, or a text file listing images.')
    parser.add_argument('--save_dir', default='output/result',
                        help='pseudo_color_prediction/ and added_prediction/ go here.')
    parser.add_argument('--device', choices=['cpu', 'gpu'], default=DEFAULT_DEVICE,
                        help='Default: gpu when Paddle sees one, else cpu.')
    add_inference_flags(parser, '--aug_pred')
    parser.add_argument('--custom_color', nargs='+', type=int, default=None,
                        help='r g b values for classes 0, 1, ..., e.g. 0 0 0 255 255 255.')
    parser.add_argument('--opts', nargs='+', default=None, help='key=value config overrides.')
    return parser.parse_args(argv)


def main(argv=None):
    options = vars(parse_args(argv))
    # Imported after the flags are parsed: --help and flag errors come before Paddle loads.
    from psanet.core.predict import predict_from_config
    return run_cli(predict_from_config, **options)


if __name__ == '__main__':
    exit_with(main())
