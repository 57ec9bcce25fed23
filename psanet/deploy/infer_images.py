"""A :class:`~psanet.deploy.pipeline.Pipeline` over image files: the loop of
deploy/python/infer.py (``infer``, an export) and of predict.py (the dygraph model).

Both write :func:`psanet.contract.save_prediction`'s two outputs
(``<save_dir>/pseudo_color_prediction/<rel>.png`` and
``<save_dir>/added_prediction/<rel>``); ``infer(benchmark=True)`` prints the
preprocess / inference / postprocess time per image as a table. An image that
cannot be read is reported and skipped; the others are still written, and the
run ends with ``UnreadableImagesError`` naming the skipped ones.
"""
import os

from psanet import interrupts
from psanet.contract import check_outputs, color_map, get_image_list, read_images, save_prediction
from psanet.errors import DeployError, UnreadableImagesError, is_integer
from psanet.files import check_save_dir
from psanet.log import ProgressBar, get_logger

from .deploy_config import DeployConfig
from .predictor import PredictorOptions
from .backends import EXPORT_BACKENDS
from .pipeline import Pipeline
from .timing import StageTimer, format_table

__all__ = ['segment_files', 'infer']

# Benchmark: untimed runs of the first batch first, so that one-time work
# (oneDNN primitive creation, allocator growth) is not counted.
WARMUP_RUNS = 3


def _readable_batches(images, batch_size, unreadable, logger, timer):
    """Batches of ``(image, relative path)`` of the images that can be read.

    Images are read as the batches are consumed, the reading timed as part of
    'preprocess'; each one that cannot be read is logged, appended to
    ``unreadable`` and left out, so that the batches after it still run.
    """
    batch = []
    readable = read_images(images, unreadable, logger)
    while True:
        with timer.stage('preprocess'):
            item = next(readable, None)
        if item is None:
            break
        batch.append(item)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def segment_files(segmenter, images, save_dir, colors, logger=None, timer=None, warmup_runs=0,
                  on_progress=None):
    """Segments image files, ``segmenter.batch_size`` a run, and writes both outputs of each.

    A stop requested by a signal (:mod:`psanet.interrupts`) ends the loop before the
    next batch. The caller checks ``save_dir`` and the outputs before any work, and
    raises ``UnreadableImagesError`` for the images that could not be read.

    Args:
        segmenter (Pipeline): The model (an export's runner or the dygraph one).
        images (list): ``(image path, relative output path)`` from
            :func:`psanet.contract.get_image_list`.
        save_dir (str): Output root.
        colors (list): Flat palette from :func:`psanet.contract.color_map`.
        logger (logging.Logger, optional): Default: the 'psanet' logger.
        timer (StageTimer, optional): Times each batch's stages. Default: a new one.
        warmup_runs (int, optional): Untimed runs of the first batch first. Default: 0.
        on_progress (callable, optional): Called with the number of images done (written
            or skipped) after each batch. Default: None.

    Returns:
        tuple: ``(written, unreadable)``: the ``(pseudo colour, overlay)`` paths written,
        and the paths that could not be read.
    """
    logger = logger or get_logger()
    timer = timer or StageTimer()
    written, unreadable, reported = [], [], 0
    batches = _readable_batches(images, segmenter.batch_size, unreadable, logger, timer)
    for number, chunk in enumerate(batches):
        interrupts.raise_if_requested()
        originals = [image for image, _ in chunk]
        names = [relative for _, relative in chunk]
        for _ in range(warmup_runs if number == 0 else 0):
            batch, infos = segmenter.preprocess(originals, names)
            segmenter.postprocess(segmenter.run(batch), infos)
        with timer.stage('preprocess'):
            batch, infos = segmenter.preprocess(originals, names)
        with timer.stage('inference'):
            output = segmenter.run(batch)
        with timer.stage('postprocess'):
            labels = segmenter.postprocess(output, infos)
        timer.end_batch(len(chunk))
        for label, (image, relative) in zip(labels, chunk):
            written.append(save_prediction(label, image, relative, save_dir, colors))
        reported = _report(on_progress, len(written) + len(unreadable), reported)
    _report(on_progress, len(written) + len(unreadable), reported)  # unreadable last images
    return written, unreadable


def _report(on_progress, done, reported):
    if on_progress is not None and done != reported:
        on_progress(done)
    return done


def infer(config, image_path, save_dir='./output', batch_size=1, benchmark=False, model_name='',
          backend='paddle', **predictor_flags):
    """Runs the exported model of ``config`` (deploy.yaml) over ``image_path``.

    Args:
        config (str): deploy.yaml, or the folder holding it.
        image_path (str): an image, a folder of images, or a list file.
        save_dir (str, optional): Output root. Default: './output'.
        batch_size (int, optional): Images per predictor run. Default: 1.
        benchmark (bool, optional): Warm up, then print the per-image stage times. Default: False.
        model_name (str, optional): Named in the benchmark table's title. Default: ''.
        backend (str, optional): 'paddle' (Paddle Inference), 'onnxruntime' or 'openvino'
            (:mod:`psanet.deploy.backends`, the runners of :class:`psanet.Segmenter`).
            Default: 'paddle', as PaddleSeg's infer.py runs.
        **predictor_flags: infer.py's ``device``, ``use_trt``, ``precision``,
            ``enable_mkldnn``, ``cpu_threads`` (None: 10 or the cores, if fewer) and
            ``print_detail`` (:class:`psanet.deploy.predictor.PredictorOptions`); with an
            ONNX backend ``precision='int8'`` runs the export's INT8 model.

    Returns:
        dict: ``{'written': [(pseudo, overlay), ...], 'times': {stage: (mean, p50, p90)}}``.

    Raises:
        UnreadableImagesError: after every readable image is written, when some
            could not be read (each is also logged as it is skipped).
    """
    logger = get_logger()
    if not is_integer(batch_size, 1):
        raise DeployError(f'--batch_size must be an integer >= 1, got {batch_size!r}.')
    check_save_dir(save_dir)
    deploy = DeployConfig(config)
    images = get_image_list(image_path)
    check_outputs(images, save_dir)
    if backend not in EXPORT_BACKENDS:
        raise DeployError(f'--backend must be one of {EXPORT_BACKENDS}, got {backend!r}.')
    # On an ONNX backend --precision int8 picks the export's INT8 model; PredictorOptions
    # holds Paddle Inference's precision, fp32 there.
    int8 = backend != 'paddle' and predictor_flags.get('precision') == 'int8'
    options = PredictorOptions(**(dict(predictor_flags, precision='fp32') if int8
                                  else predictor_flags))
    segmenter = Pipeline.from_deploy(deploy, backend, options, int8, batch_size)
    onednn = 'on' if options.enable_mkldnn else 'off'
    engine = f'Paddle Inference, oneDNN {onednn}' if backend == 'paddle' else backend
    precision = 'int8' if int8 else options.precision
    model_file = deploy.model if backend == 'paddle' else \
        deploy.onnx_int8 if int8 else deploy.onnx
    logger.info(f'Inferring {len(images)} images with {model_file} on {options.device} '
                f'({engine}, batch size {batch_size}) ...')
    colors = color_map(deploy.num_classes, cityscapes=deploy.palette == 'cityscapes')
    timer = StageTimer()
    if benchmark:
        logger.info(f'Benchmark: {WARMUP_RUNS} untimed warm-up runs of the first batch '
                    '(one-time setup such as oneDNN primitives), then the timed runs ...')
    with ProgressBar(len(images), unit='image') as bar:  # predict.py's bar, paddleseg-free
        written, unreadable = segment_files(segmenter, images, save_dir, colors, logger, timer,
                                            WARMUP_RUNS if benchmark else 0, bar.update)
    logger.info(f'Results are saved in {os.path.join(save_dir, "pseudo_color_prediction")} '
                f'and {os.path.join(save_dir, "added_prediction")} .')
    times = timer.summary()
    if benchmark:
        prefix = f'{model_name}: ' if model_name else ''
        title = (f'{prefix}ms per image over {len(written)} images, batch size {batch_size}, '
                 f'{options.device}, {engine}, {options.cpu_threads} threads, '
                 f'{precision}:')
        print(format_table(times, title), flush=True)
    if unreadable:
        raise UnreadableImagesError(unreadable, len(images), written, save_dir)
    return {'written': written, 'times': times}
