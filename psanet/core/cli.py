"""Command-line pieces shared by val.py and predict.py."""

__all__ = ['add_inference_flags']


def add_inference_flags(parser, aug_flag):
    """The inference flags val.py and predict.py share (None: use the config's test_config)."""
    parser.add_argument(aug_flag, action='store_true', default=None,
                        help='Average softmax over --scales and flips.')
    parser.add_argument('--scales', nargs='+', type=float, default=None,
                        help='Scales for augmentation, e.g. 0.75 1.0 1.25.')
    parser.add_argument('--flip_horizontal', action='store_true', default=None,
                        help='Add horizontally flipped inputs to the augmentation.')
    parser.add_argument('--flip_vertical', action='store_true', default=None,
                        help='Add vertically flipped inputs to the augmentation.')
    parser.add_argument('--is_slide', action='store_true', default=None,
                        help='Sliding-window inference.')
    parser.add_argument('--crop_size', nargs=2, type=int, default=None,
                        help='Window width and height for --is_slide.')
    parser.add_argument('--stride', nargs=2, type=int, default=None,
                        help='Window step width and height for --is_slide.')
