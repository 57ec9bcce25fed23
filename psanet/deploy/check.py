"""Compares an exported model with the dygraph model it came from, on real images."""
import numpy as np

from .config import DeployConfig
from .predictor import OnnxRunner, PaddleRunner
from .processing import preprocess

__all__ = ['compare_with_dygraph']


def compare_with_dygraph(model, deploy, image_paths, backend='paddle', **predictor_options):
    """Runs ``image_paths`` through ``model`` (dygraph) and the export ``deploy`` describes.

    Args:
        model (paddle.nn.Layer): The dygraph model the export was made from.
        deploy (DeployConfig|str): The export's deploy config or its path.
        image_paths (list[str]): Images, preprocessed with the export's transforms.
        backend (str, optional): 'paddle' (Paddle Inference) or 'onnxruntime' (model.onnx).
            Default: 'paddle'.
        **predictor_options: ``create_predictor`` options (enable_mkldnn, cpu_threads, ...),
            or ``cpu_threads`` for onnxruntime.

    Returns:
        dict: ``images``; ``pixel_agreement``, the fraction of pixels whose class is
        the same; ``max_abs_diff``, the largest difference of the exported output
        from the dygraph logits (or their softmax), None for an argmax export.
    """
    import paddle
    deploy = deploy if isinstance(deploy, DeployConfig) else DeployConfig(deploy)
    if backend == 'onnxruntime':
        runner = OnnxRunner(deploy, **predictor_options)
    else:
        runner = PaddleRunner(deploy, **predictor_options)
    transforms = deploy.build_transforms()
    was_training = model.training
    model.eval()
    agree, total, max_diff = 0, 0, 0.0
    try:
        for path in image_paths:
            batch, _, _ = preprocess([path], transforms)
            with paddle.no_grad():
                logit = model(paddle.to_tensor(batch))[0].numpy()
            exported = runner.run(batch)
            if deploy.output_op == 'argmax':
                labels = exported[:, 0]
            else:
                labels = exported.argmax(1)
                want = logit
                if deploy.output_op == 'softmax':
                    e = np.exp(logit - logit.max(1, keepdims=True))
                    want = e / e.sum(1, keepdims=True)
                max_diff = max(max_diff, float(np.abs(exported - want).max()))
            agree += int((labels == logit.argmax(1)).sum())
            total += labels.size
    finally:
        if was_training:
            model.train()
    return {'images': len(image_paths), 'pixel_agreement': agree / max(total, 1),
            'max_abs_diff': None if deploy.output_op == 'argmax' else max_diff}
