"""Train a segmentation model from a config (PaddleSeg's train.py flags).

    python train.py --config configs/psanet/psanet_resnet18_os8_mini_cityscapes_128x64_100.yml \
        --device cpu --save_dir output/mini --do_eval --save_interval 50
    # 4 cards x 2 images = the recipe's 8 images per step (batch_size is per card):
    python -m paddle.distributed.launch --gpus 0,1,2,3 train.py \
        --config configs/psanet/psanet_resnet50_os8_cityscapes_1024x512_80k.yml --batch_size 2 --do_eval
"""
import argparse

from psanet.cli import exit_with, run_cli
from psanet.core.options import AMP_LEVELS, DEFAULT_DEVICE, DYGRAPH_PRECISIONS


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='PSANet training (PaddleSeg flags).',
        epilog='SIGTERM (a scheduler preempting the job) or Ctrl-C: the run ends after its step (or '
        'the next one), saves iter_<step> in --save_dir, logs the command that resumes from it and exits 143 '
        '(130 for Ctrl-C); a second Ctrl-C ends it at once. Under paddle.distributed.launch '
        'every rank stops after the same step.')
    parser.add_argument('--config', required=True, help='The config file.')
    parser.add_argument('--device', choices=['cpu', 'gpu'], default=DEFAULT_DEVICE,
                        help='Default: gpu when Paddle sees one, else cpu.')
    parser.add_argument('--save_dir', default='output',
                        help='Checkpoints, train.log and VisualDL logs go here.')
    parser.add_argument('--iters', type=int, default=None, help='Overrides iters of the config.')
    parser.add_argument('--batch_size', type=int, default=None,
                        help='Images per card (per process): on 4 cards, --batch_size 2 is 8 '
                        'images per step; overrides batch_size of the config.')
    parser.add_argument('--learning_rate', type=float, default=None,
                        help='Overrides lr_scheduler.learning_rate of the config.')
    parser.add_argument('--save_interval', type=int, default=1000,
                        help='Iterations between checkpoints (and evaluations with --do_eval).')
    parser.add_argument('--log_iters', type=int, default=10, help='Iterations between log lines.')
    parser.add_argument('--keep_checkpoint_max', type=int, default=5,
                        help='iter_N checkpoints kept, the newest; 0 keeps every one.')
    parser.add_argument('--num_workers', type=int, default=0, help='DataLoader worker processes.')
    parser.add_argument('--do_eval', action='store_true',
                        help='Evaluate every save_interval and keep best_model/.')
    parser.add_argument('--use_vdl', action='store_true',
                        help='Write VisualDL scalars, and the evaluation figures as images.')
    parser.add_argument('--resume_model', default=None,
                        help='An iter_N folder to continue from, or auto: the newest checkpoint '
                        'in --save_dir that loads, else start (so the same command can be run '
                        'again after any stop).')
    parser.add_argument('--overwrite', action='store_true',
                        help='Delete the checkpoints (iter_N, best_model) another run left in '
                        '--save_dir, or those after --resume_model, and start over; without it '
                        'such a --save_dir is refused.')
    parser.add_argument('--seed', type=int, default=None, help='Random seed.')
    parser.add_argument('--precision', choices=DYGRAPH_PRECISIONS, default='fp32',
                        help='fp16: autocast + GradScaler (GPU only).')
    parser.add_argument('--amp_level', choices=AMP_LEVELS, default='O1',
                        help='O1: mixed precision; O2: fp16 weights except BatchNorm.')
    parser.add_argument('--opts', nargs='+', default=None,
                        help='key=value config overrides, e.g. --opts batch_size=2 '
                        'model.backbone.output_stride=16.')
    return parser.parse_args(argv)


def main(argv=None):
    options = vars(parse_args(argv))
    # Imported after the flags are parsed: --help and flag errors come before Paddle loads.
    from psanet.core.train import train_from_config
    return run_cli(train_from_config, **options)


if __name__ == '__main__':
    exit_with(main())
