"""Export a trained model for deployment (PaddleSeg's export.py flags, plus --psa_impl, --onnx).

    python export.py --config configs/psanet/psanet_resnet50_os8_cityscapes_1024x512_80k.yml \
        --model_path output/best_model/model.pdparams --save_dir output/inference_model
    python export.py --config <cfg> --model_path <pdparams> --save_dir output/onnx \
        --psa_impl paddle --onnx [--quantize int8 --calib_images <val images> --calib_num 32]
"""
import argparse

from psanet.cli import exit_with, run_cli


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='PSANet export (PaddleSeg flags).')
    parser.add_argument('--config', required=True, help='The config file.')
    parser.add_argument('--model_path', default=None,
                        help='model.pdparams, a checkpoint folder such as output/best_model, or an '
                        'http(s) URL of a .pdparams or of a .zip/.tar.gz holding one '
                        '(downloaded once into $PSANET_WEIGHTS_CACHE; #sha256=<hex> at its '
                        'end checks it).')
    parser.add_argument('--save_dir', default='output/inference_model',
                        help='model.json, model.pdiparams and deploy.yaml go here.')
    parser.add_argument('--input_shape', nargs=4, default=None, metavar=('N', 'C', 'H', 'W'),
                        help='Fixed input shape, e.g. 1 3 512 1024; None for a dynamic '
                        'dimension. Default: None 3 None None (any batch and size).')
    parser.add_argument('--output_op', default='argmax',
                        help='argmax: int32 class ids [N, H, W]; softmax: probabilities '
                        '[N, C, H, W]; none: logits [N, C, H, W] (as PaddleSeg\'s export.py).')
    parser.add_argument('--psa_impl', default='custom',
                        help='custom: the C++/CUDA op (needs its library at run time); '
                        'paddle: standard ops only (no library; exports to ONNX).')
    parser.add_argument('--onnx', action='store_true',
                        help='Also write model.onnx with paddle2onnx (needs --psa_impl paddle).')
    parser.add_argument('--quantize', default=None, choices=['int8'],
                        help='int8: also write model_int8.onnx, quantised for the CPU with '
                        '--calib_images (needs --psa_impl paddle --onnx; pip install ml_dtypes).')
    parser.add_argument('--calib_images', default=None,
                        help='Calibration images for --quantize (folder, image or list file).')
    parser.add_argument('--calib_num', type=int, default=32,
                        help='How many calibration images to use (default 32).')
    parser.add_argument('--check_image_path', default=None,
                        help='Images (file, folder or list) to run through the dygraph and the '
                        'exported model, printing how far they agree.')
    parser.add_argument('--opts', nargs='+', default=None, help='key=value config overrides.')
    return parser.parse_args(argv)


def main(argv=None):
    options = vars(parse_args(argv))
    # Imported after the flags are parsed: --help and flag errors come before Paddle loads.
    from psanet.export import export_from_config
    return run_cli(export_from_config, **options)


if __name__ == '__main__':
    exit_with(main())
