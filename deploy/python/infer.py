"""Run an exported model with Paddle Inference (PaddleSeg's deploy/python/infer.py flags).

    python deploy/python/infer.py --config output/inference_model/deploy.yaml \
        --image_path data/mini_cityscapes/leftImg8bit/val --device cpu --enable_mkldnn True \
        --benchmark True

Writes pseudo_color_prediction/ and added_prediction/ under --save_dir, like predict.py.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..'))

from psanet.cli import exit_with, run_cli  # noqa: E402
from psanet.deploy.infer_images import infer  # noqa: E402


def str2bool(value):
    # PaddleSeg's TIPC passes booleans as `--flag=True` / `--flag=False`.
    if value.lower() in ('true', '1', 'yes'):
        return True
    if value.lower() in ('false', '0', 'no'):
        return False
    raise argparse.ArgumentTypeError(f'expected True or False, got {value!r}')


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='PSANet Paddle Inference (PaddleSeg flags).')
    parser.add_argument('--config', required=True, help='deploy.yaml written by export.py.')
    parser.add_argument('--image_path', required=True,
                        help='An image, a folder of images, or a text file listing images.')
    parser.add_argument('--batch_size', type=int, default=1, help='Images per predictor run.')
    parser.add_argument('--save_dir', default='./output',
                        help='pseudo_color_prediction/ and added_prediction/ go here.')
    parser.add_argument('--device', default='cpu', help='cpu or gpu.')
    parser.add_argument('--use_trt', type=str2bool, default=False,
                        help='TensorRT subgraphs (GPU).')
    parser.add_argument('--precision', default='fp32',
                        help='fp32, or fp16/int8 with --use_trt True on the GPU.')
    parser.add_argument('--enable_mkldnn', type=str2bool, default=False,
                        help='oneDNN for the CPU convolutions.')
    parser.add_argument('--cpu_threads', type=int, default=10,
                        help='Math library threads on the CPU.')
    parser.add_argument('--benchmark', type=str2bool, default=False,
                        help='Print preprocess / inference / postprocess ms per image.')
    parser.add_argument('--model_name', default='',
                        help='Shown in the --benchmark table (TIPC passes it).')
    parser.add_argument('--print_detail', type=str2bool, default=False,
                        help="Keep Paddle Inference's glog output.")
    return parser.parse_args(argv)


if __name__ == '__main__':
    exit_with(run_cli(infer, **vars(parse_args())))
