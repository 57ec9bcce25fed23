"""What the paddleseg records of psanet.compat do: the one-line message when paddleseg is
missing, and the fixes a config build applies (``import psanet.models``)."""
from .workarounds import PADDLESEG_CROSS_ENTROPY

__all__ = ['PADDLESEG_INSTALL', 'require_paddleseg', 'apply_paddleseg_fixes',
           'cross_entropy_reduction', 'quiet_builder_messages', 'BUILDER_MESSAGE', 'FIXES',
           'ORIGINALS']

PADDLESEG_INSTALL = ('pip install -r requirements.txt && pip install --no-deps -r '
                     'requirements-paddleseg.txt')
BUILDER_MESSAGE = 'Use the following config to build'

# (owner, attribute, replacement) of each paddleseg fix this Paddle and paddleseg need,
# filled in place by apply_paddleseg_fixes().
FIXES = []
# The replaced attributes, for the tests that check the fixes are still needed.
ORIGINALS = {}


def require_paddleseg():
    """Raises ImportError in one line saying what to install when paddleseg, or a module
    it imports without declaring it, is missing."""
    try:
        import paddleseg  # noqa: F401
    except ModuleNotFoundError as error:
        if error.name == 'paddleseg':
            what = 'psanet needs paddleseg 2.8.0'
        else:
            what = f'paddleseg needs {error.name}, which is not installed'
        raise ImportError(f'{what}: {PADDLESEG_INSTALL} (in the repository; paddleseg goes '
                          'without its dependencies, whose opencv<=4.6 pin forces numpy<2).'
                          ) from None


def cross_entropy_reduction(loss_layer, logit, label, semantic_weights, loss):
    """The float32 scalar a paddleseg ``CrossEntropyLoss`` makes of its pixel losses, in dtypes
    Paddle 3 accepts (PADDLESEG_CROSS_ENTROPY): the mean pixel loss over the mean class weight
    of the pixels it counts. ``loss``: the class-weighted cross entropy of each pixel, 0 where
    ignored; ``semantic_weights``: a weight per pixel, or None."""
    import paddle
    scored = label != loss_layer.ignore_index
    # The pixels the mean is over: the scored ones, or all of them.
    counted = (paddle.cast(scored, 'float32') if loss_layer.avg_non_ignore
               else paddle.ones(label.shape, dtype='float32'))
    if loss.ndim > counted.ndim:  # soft labels: [..., 1]
        loss = paddle.squeeze(loss, axis=-1)
    loss = loss * counted
    if semantic_weights is not None:
        loss = loss * semantic_weights
    # Each pixel's class weight; an ignored one takes class 0's, which `counted` drops
    # unless every pixel counts.
    if loss_layer.weight is None:
        class_weight = paddle.ones(label.shape, dtype='float32')
    else:
        classes = paddle.where(scored, label, paddle.zeros_like(label))
        class_weight = paddle.gather(loss_layer.weight, classes.flatten()).reshape(label.shape)
    if loss_layer.top_k_percent_pixels == 1.0:
        return paddle.mean(loss) / (paddle.mean(counted * class_weight) + loss_layer.EPS)
    # Hard pixel mining: the mean over the k largest pixel losses.
    k = int(loss_layer.top_k_percent_pixels * loss.numel())
    hardest, at = paddle.topk(loss.flatten(), k)
    return hardest.mean() / (paddle.gather(class_weight.flatten(), at).mean() + loss_layer.EPS)


_NO_BUILDER_MESSAGE = classmethod(lambda cls, name, cfg: None)  # show_msg without the YAML


def quiet_builder_messages():
    """Makes paddleseg's ``Builder.show_msg`` a no-op (BUILDER_YAML), the original kept in
    ORIGINALS."""
    from paddleseg.cvlibs.builder import Builder
    if Builder.__dict__['show_msg'] is not _NO_BUILDER_MESSAGE:
        ORIGINALS[(Builder, 'show_msg')] = Builder.__dict__['show_msg']
        Builder.show_msg = _NO_BUILDER_MESSAGE


def apply_paddleseg_fixes():
    """Replaces what this Paddle breaks in paddleseg (PADDLESEG_CROSS_ENTROPY), once, and quiets
    its builder (BUILDER_YAML); returns ``FIXES``, the (owner, attribute, replacement) applied."""
    from paddleseg.models.losses import CrossEntropyLoss
    candidates = ((PADDLESEG_CROSS_ENTROPY, CrossEntropyLoss, '_post_process_loss',
                   cross_entropy_reduction),)
    FIXES[:] = [(owner, name, fixed) for record, owner, name, fixed in candidates
                if record.needed()]
    for owner, name, fixed in FIXES:
        current = getattr(owner, name)
        if current is not fixed:
            ORIGINALS[(owner, name)] = current
            setattr(owner, name, fixed)
    quiet_builder_messages()
    return tuple(FIXES)
