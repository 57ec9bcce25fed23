"""Run an exported model with Paddle Inference (PaddleSeg's deploy/python/infer.py flags), or
with onnxruntime or OpenVINO (``--backend``).

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
from psanet.deploy.predictor import (DEFAULT_CPU_THREADS, DEFAULT_DEVICE,  # noqa: E402
                                     INFER_ENABLE_MKLDNN)


def str2bool(value):
    # PaddleSeg's TIPC passes booleans as `--flag=True` / `--flag=False`.
    if value.lower() in ('true', '1', 'yes'):
        return True
    if value.lower() in ('false', '0', 'no'):
        return False
    raise argparse.ArgumentTypeError(f'expected True or False, got {value!r}')


# PaddleSeg's flags after --config and --image_path: (name, type, default, help).
FLAGS = (
    ('batch_size', int, 1, 'Images per predictor run.'),
    ('save_dir', str, './output', 'pseudo_color_prediction/ and added_prediction/ go here.'),
    ('device', str, DEFAULT_DEVICE, 'cpu or gpu.'),
    ('use_trt', str2bool, False, 'TensorRT subgraphs (GPU).'),
    ('precision', str, 'fp32', 'fp32; fp16 with --use_trt True on the GPU; int8 with --backend '
     'onnxruntime or openvino (the INT8 model, on the CPU).'),
    ('enable_mkldnn', str2bool, INFER_ENABLE_MKLDNN, 'oneDNN for the CPU convolutions.'),
    ('cpu_threads', int, None, f'Math library threads on the CPU. Default: '
     f'{DEFAULT_CPU_THREADS}, or the cores this process may use when fewer.'),
    ('benchmark', str2bool, False, 'Print preprocess / inference / postprocess ms per image.'),
    ('model_name', str, '', 'Shown in the --benchmark table (TIPC passes it).'),
    ('print_detail', str2bool, False, "Keep Paddle Inference's glog output."),
    ('backend', str, 'paddle', 'paddle (Paddle Inference), onnxruntime or openvino (these two '
     'run model.onnx of a --psa_impl paddle --onnx export; --precision int8 runs its INT8 '
     'model).'),
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='PSANet Paddle Inference (PaddleSeg flags).')
    parser.add_argument('--config', required=True, help='deploy.yaml written by export.py.')
    parser.add_argument('--image_path', required=True,
                        help='An image, a folder of images, or a text file listing images.')
    for name, type_, default, help_ in FLAGS:
        parser.add_argument('--' + name, type=type_, default=default, help=help_)
    return parser.parse_args(argv)


def main(argv=None):
    options = vars(parse_args(argv))
    # Imported after the flags are parsed: --help and flag errors come before Paddle loads.
    from psanet.deploy.infer_images import infer
    return run_cli(infer, **options)


if __name__ == '__main__':
    exit_with(main())
