"""Paddle Inference on the CPU, the way the tests drive it: one config, one run.

Imports no psanet module, so a test's fresh subprocess can use it to show
that an exported graph runs without the package.
"""
__all__ = ['cpu_config', 'create', 'run_once', 'predict']


def cpu_config(path, onednn, threads=None, placement=True):
    """A CPU ``paddle.inference.Config`` for ``path``.json/.pdiparams.

    Args:
        path (str): the exported model, without suffix.
        onednn (bool): oneDNN on or off (off explicitly: Paddle turns it on by default).
        threads (int, optional): the math library's threads. Default: Paddle's.
        placement (bool, optional): keep oneDNN's op placement pass; False drops it,
            as psanet.compat does for Paddle's bilinear_interp bug. Default: True.
    """
    from paddle import inference
    config = inference.Config(path + '.json', path + '.pdiparams')
    config.disable_gpu()
    config.disable_glog_info()
    if onednn:
        config.enable_mkldnn()
        if not placement:
            config.delete_pass('onednn_placement_pass')
    else:
        config.disable_mkldnn()
    if threads is not None:
        config.set_cpu_math_library_num_threads(threads)
    return config


def create(config):
    from paddle import inference
    return inference.create_predictor(config)


def run_once(predictor, x):
    """The first output of ``predictor`` on the one input ``x``."""
    handle = predictor.get_input_handle(predictor.get_input_names()[0])
    handle.reshape(list(x.shape))
    handle.copy_from_cpu(x)
    predictor.run()
    return predictor.get_output_handle(predictor.get_output_names()[0]).copy_to_cpu()


def predict(config, x):
    """Creates a predictor from ``config`` and runs it once on ``x``."""
    return run_once(create(config), x)
