"""The records: one per workaround for an upstream release, and one per use of an upstream name
outside the public API. tests/test_compat.py reads them; docs/design.md says how to retire one."""
import re
from dataclasses import dataclass
from typing import Optional, Tuple

Version = Tuple[int, ...]

_ISSUES = 'https://github.com/PaddlePaddle/{}/issues/{}'
NONE_FILED = 'none filed'
NO_PUBLIC_API = 'no public API'
# The Paddle releases the version gates were measured on (3.1.0 and 3.3.0 were not run).
P300, P311, P322, P331 = (3, 0, 0), (3, 1, 1), (3, 2, 2), (3, 3, 1)


def parse_version(text):
    """'3.3.1' -> (3, 3, 1); '3.0.0rc1' -> (3, 0, 0). A develop build ('0.0.0') counts
    as newer than any release."""
    numbers = tuple(int(n) for n in re.findall(r'\d+', text.split('+')[0])[:3])
    return (10 ** 6,) if not any(numbers) else numbers


def _three(version):
    return tuple(version) + (0,) * (3 - len(version))


@dataclass(frozen=True)
class Workaround:
    """One record.

    Attributes:
        name (str): the constant of ``psanet.compat`` that holds it.
        what (str): what breaks upstream, and what the project does.
        where (tuple): the places that do it, ``path`` or ``path:name`` from the repository root.
        issue (str): the upstream issue's address, ``NONE_FILED`` or ``NO_PUBLIC_API``.
        versions (str): the releases that need it, as far as measured.
        test (str | None): ``tests/file.py::test_name``, which fails once the record stops being
            true (the workaround unneeded, or the name it uses gone); None where none can tell.
        private (tuple): the upstream names with a leading underscore it uses, qualified.
        first, fixed (tuple | None): the gate: Paddle from ``first`` up to, not including,
            ``fixed`` (None: no release fixes it yet). ``first`` None: done on every release.
        paddleseg (tuple | None): for a fix of paddleseg's code, the release it fixes.
        measured (tuple): ``(release, needed)`` pairs, from runs on those Paddle releases.
    """
    name: str
    what: str
    where: Tuple[str, ...]
    issue: str
    versions: str
    test: Optional[str]
    private: Tuple[str, ...] = ()
    first: Optional[Version] = None
    fixed: Optional[Version] = None
    paddleseg: Optional[Version] = None
    measured: Tuple[Tuple[Version, bool], ...] = ()

    def needed(self, paddle_version=None, paddleseg_version=None):
        """The gate; the versions default to those installed."""
        if self.first is None:
            return True
        import paddle
        version = parse_version(paddle.__version__) if paddle_version is None \
            else paddle_version
        version = _three(version)  # (3, 1) and (3, 1, 0) are one release
        if version < _three(self.first) or (self.fixed is not None and
                                             version >= _three(self.fixed)):
            return False
        if self.paddleseg is None:
            return True
        if paddleseg_version is None:
            import paddleseg
            paddleseg_version = parse_version(paddleseg.__version__)
        return paddleseg_version == self.paddleseg


_COMPAT = 'tests/test_compat.py::'

NO_CCACHE_NOTICE = Workaround(
    'NO_CCACHE_NOTICE',
    "Every `import paddle` warns 'No ccache found' (cpp_extension looks for ccache), before "
    'any real error of our tools; the op builds without ccache. The warning is filtered when '
    'psanet.compat is imported, which psanet.cli, psanet.core and psanet.models do first.',
    ('psanet/compat/__init__.py:CCACHE_WARNING', 'psanet/cli.py:compat'),
    _ISSUES.format('Paddle', 75836), 'Paddle 3.0 to 3.3.1 at least',
    None)  # printed only where ccache is missing; a filter of a silent warning does nothing
MEMORY_OPTIM = Workaround(
    'MEMORY_OPTIM',
    '`enable_memory_optim()` fails predictor creation for PIR programs ("Not find '
    'predictor_id 0 and pass_name memory_optimize_pass"): left off; on where not needed.',
    ('psanet/compat/fixes.py:configure_inference',
     'psanet/deploy/predictor.py:configure_inference'),
    _ISSUES.format('Paddle', 75496), 'Paddle >= 3.0 (open)',
    _COMPAT + 'test_memory_optim_workaround_is_still_needed_on_this_paddle', first=(3, 0))
ONEDNN_PLACEMENT = Workaround(
    'ONEDNN_PLACEMENT',
    'With oneDNN on, a saved `bilinear_interp` cannot run as a oneDNN kernel: 3.3 refuses it '
    '("ConvertPirAttribute2RuntimeAttribute not support ArrayAttribute<DoubleAttribute>"), '
    '3.0 to 3.2 run it ignoring align_corners=True (logits off by 8 in the mini PSANet). '
    '`onednn_placement_pass` is deleted: the fused convolutions still run in oneDNN, the other '
    'ops take their plain kernels. The deletion also keeps the pure-Paddle op\'s `pad` off '
    "oneDNN's pad kernel, which crashes the process, hangs it or pads the wrong axes there "
    '(seen on 3.3.1; not tested: a run may hang).',
    ('psanet/compat/fixes.py:configure_inference', 'psanet/deploy/predictor.py:ONEDNN_PLACEMENT'),
    _ISSUES.format('Paddle', 79749), 'Paddle >= 3.0 (open)',
    _COMPAT + 'test_onednn_placement_workaround_is_needed_where_its_record_says', first=(3, 0),
    measured=((P300, True), (P311, True), (P322, True), (P331, True)))
ONEDNN_LAYOUT_INPUT = Workaround(
    'ONEDNN_LAYOUT_INPUT',
    "The CPU predictor with oneDNN hands a custom op its input in oneDNN's blocked layout, "
    "with no reorder in front as for built-in ops. The op reorders it with Paddle's "
    '`TransDataLayoutFromOneDNN`, declared by hand (its header needs oneDNN headers) and weak.',
    ('ops/psa_mask.cc:TransDataLayoutFromOneDNN',), NONE_FILED, 'Paddle 3.x with oneDNN',
    None)  # it acts on oneDNN-layout input only
ENFORCE_NOT_MET = Workaround(
    'ENFORCE_NOT_MET',
    "The inference executor reports PD_CHECK's exception as a bare 'std::exception'. The op "
    "throws Paddle's EnforceNotMet (InvalidArgument; External for a failed CUDA launch), built "
    'by hand.',
    ('ops/psa_mask_common.h:PSA_MASK_CHECK', 'ops/psa_mask.cc:EnforceNotMet'), NONE_FILED,
    'Paddle 3.x', None)  # EnforceNotMet is Paddle's own error type
CORE_LIBRARY_NAME = Workaround(
    'CORE_LIBRARY_NAME',
    "Only a private function knows the file name of Paddle's core library, which the op "
    "links; the fallback is the file name of the `paddle.base.libpaddle` module.",
    ('psanet/ops/build.py:paddle_core_library',), NO_PUBLIC_API, 'Paddle 3.x (libpaddle.so)',
    _COMPAT + 'test_paddle_core_library_is_the_core_module_file',
    private=('paddle.utils.cpp_extension.extension_utils._get_core_name',))
OP_REGISTRATION = Workaround(
    'OP_REGISTRATION',
    'A built op library is registered with `load_op_meta_info_and_register_op`: undocumented, '
    "not in cpp_extension's __all__, but what the stubs of Paddle's own cpp_extension.setup "
    'call; the fallback is the same function in extension_utils.',
    ('psanet/ops/library.py:register_op_library',), NO_PUBLIC_API, 'Paddle 3.x',
    'tests/test_psa_mask_build.py::test_loading_a_built_library_prints_nothing')
PADDLESEG_CROSS_ENTROPY = Workaround(
    'PADDLESEG_CROSS_ENTROPY',
    "paddleseg's `CrossEntropyLoss._post_process_loss` mixes int64 and float32 operands, "
    'which Paddle 3 no longer promotes: replaced by our own reduction of the pixel losses.',
    ('psanet/compat/paddleseg_fixes.py:cross_entropy_reduction',
     'psanet/compat/paddleseg_fixes.py:apply_paddleseg_fixes',
     'psanet/models/__init__.py:apply_paddleseg_fixes'),
    NONE_FILED, 'Paddle >= 3.0 with paddleseg 2.8.0',
    _COMPAT + 'test_paddleseg_cross_entropy_is_still_broken_on_this_paddle',
    private=('paddleseg.models.losses.CrossEntropyLoss._post_process_loss',),
    first=(3, 0), paddleseg=(2, 8, 0))
PADDLESEG_CALCULATE_AREA = Workaround(
    'PADDLESEG_CALCULATE_AREA',
    "paddleseg's `metrics.calculate_area` concatenates 0-D tensors, which Paddle >= 2.6 "
    'refuses: the engine counts the areas itself and never calls it.',
    ('psanet/core/metrics.py:class_areas',),
    _ISSUES.format('PaddleSeg', 3556), 'Paddle >= 2.6 with paddleseg 2.8.0',
    _COMPAT + 'test_paddleseg_calculate_area_is_still_broken_where_its_record_says',
    first=(2, 6), paddleseg=(2, 8, 0))
LOADER_SHUTDOWN = Workaround(
    'LOADER_SHUTDOWN',
    'A DataLoader iterator left before its end (an exception, a signal) is never shut down: '
    'its reader thread refers to it, so its __del__ does not run, and at exit Paddle shuts '
    'down only the last loader; its workers and thread live on (an interrupted run waits for '
    "them or leaves their shared memory in /dev/shm). The iterator's private shutdown is called, "
    'as the end of an epoch does.',
    ('psanet/compat/fixes.py:shut_down_loader', 'psanet/core/data_loader.py:shut_down_loader'),
    NONE_FILED, 'Paddle 3.x (3.3.1)',
    'tests/test_compat_records.py::test_the_private_names_the_records_use_are_still_there',
    private=('paddle.io.dataloader.dataloader_iter._DataLoaderIterMultiProcess._try_shutdown_all',
             'paddle.io.dataloader.dataloader_iter._DataLoaderIterSingleProcess._try_shutdown_all'))
NUMPY_IN1D = Workaround(
    'NUMPY_IN1D',
    'cityscapesScripts calls `np.in1d`, which numpy 2.4 removed: its evaluators fail with '
    'AttributeError. numpy.in1d is set to the same function on np.isin, in the '
    "evaluator's process only, where numpy has no in1d.",
    ('psanet/compat/fixes.py:cityscapes_evaluator_fix',
     'tools/evaluate_cityscapes.py:cityscapes_evaluator_fix'),
    NONE_FILED, 'numpy >= 2.4 with cityscapesScripts <= 2.3.0 (the newest)',
    'tests/test_cityscapes_evaluator.py::'
    'test_the_in1d_numpy_lost_is_still_what_the_evaluator_calls')
CONST_CONTIGUOUS = Workaround(
    'CONST_CONTIGUOUS',
    '`paddle::Tensor::contiguous()` is not const before 3.1.1, so kernels taking their inputs '
    'as const Tensor& did not compile: they call it on a copy (`paddle::Tensor(x)`, which '
    'shares the storage). The gate is for the test only.',
    ('ops/psa_mask_cpu.cc:contiguous', 'ops/psa_mask.cu:contiguous'), NONE_FILED,
    'Paddle 3.0.0 to 3.1.0', _COMPAT + 'test_const_contiguous_record_matches_this_paddles_header',
    first=(3, 0), fixed=(3, 1, 1), measured=((P300, True), (P311, False)))
GATHER_AXIS_GRADIENT = Workaround(
    'GATHER_AXIS_GRADIENT',
    'The backward of `paddle.gather(x, index, axis=1)` gives every row of x the first '
    "row's gradient. The pure-Paddle op gathers with paddle.index_select, exact everywhere "
    'and exported to ONNX alike. The gate is for the test only.',
    ('psanet/ops/psa_mask.py:index_select',), NONE_FILED, 'Paddle 3.0.0 (right from 3.1.0)',
    _COMPAT + 'test_gather_gradient_is_wrong_where_its_record_says',
    first=(3, 0), fixed=(3, 1), measured=((P300, True), (P311, False)))
AMP_STATE_API = Workaround(
    'AMP_STATE_API',
    '`paddle.amp.is_autocast_enabled` and `get_autocast_dtype` arrive in 3.2.0. Before, the '
    "dygraph tracer's (the static program's AMP attributes') level and dtype say the same.",
    ('psanet/compat/fixes.py:autocast_dtype', 'psanet/models/psanet.py:autocast_dtype'),
    NONE_FILED, 'Paddle 3.0 to 3.1', _COMPAT + 'test_amp_state_api_record_matches_this_paddle',
    private=('paddle.base.framework._dygraph_tracer', 'paddle.base.core._get_amp_attrs',
             'paddle.base.core.Tracer._amp_level', 'paddle.base.core.Tracer._amp_dtype',
             'paddle.base.libpaddle.AmpAttrs._amp_level',
             'paddle.base.libpaddle.AmpAttrs._amp_dtype'),
    first=(3, 0), fixed=(3, 2), measured=((P311, True), (P322, False)))
PLACE_KIND = Workaround(
    'PLACE_KIND',
    'The place classes (CPUPlace, CUDAPlace) have no is_gpu_place before 3.1.1, only the '
    'generic Place a tensor reports; the default device, which only a private function '
    'gives, is such a class. It is wrapped in a generic Place.',
    ('psanet/compat/fixes.py:generic_place', 'psanet/deploy/attention_memory.py:generic_place'),
    NONE_FILED, 'Paddle 3.0 (3.1.0 not tried)',
    _COMPAT + 'test_place_kind_record_matches_this_paddle',
    private=('paddle.framework._current_expected_place',),
    first=(3, 0), fixed=(3, 1, 1), measured=((P300, True), (P311, False)))
JIT_SAVE_FORWARD = Workaround(
    'JIT_SAVE_FORWARD',
    "`paddle.jit.save` of a Layer wrapping another replaces the inner Layer's forward with a "
    "WeakMethod, so a later export of that model itself fails (\"'WeakMethod' object has no "
    "attribute '__name__'\"); it is put back after the save.",
    ('psanet/compat/fixes.py:keep_forward', 'psanet/export.py:keep_forward'), NONE_FILED,
    'Paddle 3.0.0', _COMPAT + 'test_jit_save_replaces_the_inner_forward_where_its_record_says',
    first=(3, 0), fixed=(3, 1), measured=((P300, True), (P311, False)))
PARAMETERLESS_PROGRAM = Workaround(
    'PARAMETERLESS_PROGRAM',
    "For the tests only: the predictor cannot open a program without parameters (it wants "
    "the .pdiparams jit.save writes only when there are some): the tests' programs multiply "
    'by a parameter of 1.',
    ('tests/test_psa_mask_export.py:PARAMETERLESS_PROGRAM',
     'tests/test_psa_mask_threads.py:PARAMETERLESS_PROGRAM'),
    NONE_FILED, 'Paddle 3.0.0',
    _COMPAT + 'test_parameterless_program_fails_in_the_predictor_where_its_record_says',
    first=(3, 0), fixed=(3, 1), measured=((P300, True), (P311, False)))
CPU_TENSOR_STREAM = Workaround(
    'CPU_TENSOR_STREAM',
    "For the tests only: the CPU build does not export `paddle::Tensor::stream()`, which the "
    'CUDA launchers call, so the op library with CUDA kernels built against it does not load '
    'there (paddlepaddle-gpu exports it): the test skips loading it.',
    ('tests/test_psa_mask_build.py:CPU_TENSOR_STREAM',), NONE_FILED,
    'Paddle 3.0 CPU builds (3.1.1 exports it)',
    _COMPAT + 'test_cpu_paddle_exports_tensor_stream_where_its_record_says',
    first=(3, 0), fixed=(3, 1), measured=((P300, True), (P311, False)))
FREE_GPU_MEMORY = Workaround(
    'FREE_GPU_MEMORY',
    "A GPU's free memory has a public API, paddle.cuda.mem_get_info, from 3.3. Before, "
    '`paddle.base.core.gpu_memory_available()` (GPU builds) says it for the current device.',
    ('psanet/compat/fixes.py:free_gpu_memory',
     'psanet/deploy/attention_memory.py:free_gpu_memory'),
    NONE_FILED, 'Paddle 3.0 to 3.2 (3.3.0 not tried)',
    'tests/test_memory.py::test_free_gpu_memory_record_matches_this_paddle',
    first=(3, 0), fixed=(3, 3), measured=((P322, True), (P331, False)))
BATCHNORM_TRACKING_NOTICE = Workaround(
    'BATCHNORM_TRACKING_NOTICE',
    "BatchNorm warns 'When training, we now always track global mean and variance.' at every "
    'forward in training mode: a notice with nothing to act on, which would stand between the '
    'user and the one-line error of a training that stops. Filtered on import, like the ccache '
    'notice.',
    ('psanet/compat/__init__.py:BATCHNORM_NOTICE',), NONE_FILED, 'Paddle 3.0 to 3.3.1 at least',
    _COMPAT + 'test_batchnorm_notice_is_still_printed_by_this_paddle')
BUILDER_YAML = Workaround(
    'BUILDER_YAML',
    "paddleseg's SegBuilder logs each config section as YAML (80 lines at the start of train "
    'and val): Builder.show_msg becomes a no-op.',
    ('psanet/compat/paddleseg_fixes.py:quiet_builder_messages',), NONE_FILED, 'paddleseg 2.8.0',
    _COMPAT + 'test_paddleseg_builder_still_prints_each_config_as_yaml')
PIR_OUT_TENSOR_LINE = Workaround(
    'PIR_OUT_TENSOR_LINE',
    "`paddle.add` (paddleseg's ResNet) passes out=None to its PIR op, and Paddle's C++ logs "
    '"Paddle static graph(PIR) not support input out tensor" at every export: a parameter no '
    'one set. Dropped from the C-level stderr of the export.',
    ('psanet/export.py:PIR_OUT_TENSOR', 'psanet/log.py:without_stderr_lines'), NONE_FILED,
    'Paddle 3.3.1 (others not checked)',
    _COMPAT + 'test_paddle_still_logs_pir_out_tensor_and_the_filter_drops_only_it')
ORT_INITIALIZER_LINES = Workaround(
    'ORT_INITIALIZER_LINES',
    "onnxruntime's optimiser, run by quant_pre_process, logs a coloured 'Removing "
    "initializer' for each of paddle2onnx's shape constants its folding left unused (8 on "
    'the mini PSANet). Dropped from the C-level stderr of that call.',
    ('psanet/export.py:ORT_UNUSED_INITIALIZER', 'psanet/log.py:without_stderr_lines'),
    NONE_FILED, 'onnxruntime 1.32.0 (others not checked)',
    _COMPAT + 'test_onnxruntime_still_logs_removing_initializer_on_the_int8_preprocessing')
ELASTIC_OWN_FAILURE = Workaround(
    'ELASTIC_OWN_FAILURE',
    "With --elastic_level 1 Paddle's launcher marks itself FAILED when its own pod fails "
    '(ControllerBase.watch) and counts on an etcd watch event to make it RESTARTING before its '
    'next ETCDMaster.wait_peer_ready: the event comes late or, when another node deleted the '
    'keys first, never, and the node ended instead of restarting (4 of 8 two-node runs). Its '
    'Status.fail restarts.',
    ('psanet/launch.py:restart_own_failure',), NONE_FILED, 'Paddle 3.3.1 (others not checked)',
    _COMPAT + 'test_the_elastic_launcher_still_ends_on_its_own_failure_where_its_record_says',
    first=(3, 0))
ONEDNN_INT_SCALE = Workaround(
    'ONEDNN_INT_SCALE',
    "With oneDNN on, Paddle Inference's `operator_scale_onednn_fuse_pass` folds a `scale` (a "
    'tensor times a Python number) into the elementwise op before it, and the integer kernels '
    'of those ops drop it: `arange(3) * w * 33` comes out `arange(3) * w`. The pure-Paddle PSA '
    "op's index math multiplies integer tensors by tensors only.",
    ('psanet/ops/psa_mask.py:_int64',), NONE_FILED, 'Paddle 3.3.1 (others not checked)',
    _COMPAT + 'test_onednn_drops_an_integer_scale_where_its_record_says', first=(3, 0))
OPTIMIZER_SCHEDULER = Workaround(
    'OPTIMIZER_SCHEDULER',
    "An optimizer's learning-rate scheduler, which training steps, is only its private "
    'attribute: Optimizer.get_lr() gives the rate, not the scheduler.',
    ('psanet/core/train.py:_learning_rate',), NO_PUBLIC_API, 'Paddle 3.0 to 3.3.1',
    'tests/test_train.py::test_learning_rate_follows_paddleseg_schedule_across_a_resume',
    private=('paddle.optimizer.Optimizer._learning_rate',))
SYNC_BATCHNORM_BACK = Workaround(
    'SYNC_BATCHNORM_BACK',
    'Paddle turns BatchNorm into SyncBatchNorm (convert_sync_batchnorm) but not back, and a '
    'SyncBatchNorm keeps its arguments and running statistics in private attributes only: '
    'to_plain_batchnorm reads them, as convert_sync_batchnorm reads those of a BatchNorm.',
    ('psanet/core/device.py:to_plain_batchnorm',), NO_PUBLIC_API, 'Paddle 3.0 to 3.3.1',
    'tests/test_train.py::test_to_plain_batchnorm_shares_parameters',
    private=tuple(f'paddle.nn.SyncBatchNorm.{name}' for name in (
        '_num_features', '_momentum', '_epsilon', '_weight_attr', '_bias_attr', '_data_format',
        '_mean', '_variance')))
CUSTOM_OP_CALL = Workaround(
    'CUSTOM_OP_CALL',
    'In dygraph and PIR a custom op of a loaded library is called through '
    '`paddle._C_ops._run_custom_op`, as the stub module cpp_extension generates does.',
    ('psanet/ops/psa_mask.py:_run_custom_op',), NO_PUBLIC_API, 'Paddle 3.0 to 3.3.1',
    'tests/test_psa_mask.py::test_forward_backward_match_reference',
    private=('paddle._C_ops._run_custom_op',))
TO_STATIC_GLOBALS = Workaround(
    'TO_STATIC_GLOBALS',
    'to_static runs a function that a traced forward calls as a converted copy whose module '
    'globals were copied when it was first converted: a setting read through it keeps the '
    'value of the first trace in the process (a pure-Paddle export after a custom-op one would '
    'trace the custom form). The functions that read psa_impl\'s setting are not_to_static.',
    ('psanet/ops/psa_mask.py:current_psa_impl', 'psanet/ops/psa_mask.py:psa_mask'), NONE_FILED,
    'Paddle 3.3.1 (3.0 to 3.2 not tried)',
    _COMPAT + 'test_to_static_freezes_a_global_read_where_its_record_says')

MKL_ON_AMD = Workaround(
    'MKL_ON_AMD',
    "Paddle's CPU wheels carry MKL 2019.0 (libmklml_intel.so), which on an AMD processor takes "
    'its generic code path: every Paddle matmul and the dygraph convolutions (im2col and '
    'sgemm) run 2-3x slower than on its AVX2 path (bench/bench_mkl_path.py). '
    'MKL_DEBUG_CPU_TYPE=5, read at MKL\'s first call, selects that path: importing psanet sets '
    'it on a Linux AMD CPU with AVX2 and FMA unless it is set (an empty value keeps MKL\'s own '
    'choice). oneDNN, onnxruntime and OpenVINO pick their code by instruction set already.',
    ('psanet/__init__.py:mkl_avx2_on_amd',), NONE_FILED,
    'Paddle 3.0.0 to 3.3.1 (their CPU wheels carry the same libmklml_intel.so)',
    _COMPAT + 'test_mkl_takes_another_path_on_amd_where_its_record_says')

WORKAROUNDS = (
    NO_CCACHE_NOTICE, MEMORY_OPTIM, ONEDNN_PLACEMENT, ONEDNN_LAYOUT_INPUT, ENFORCE_NOT_MET,
    CORE_LIBRARY_NAME, OP_REGISTRATION, PADDLESEG_CROSS_ENTROPY, PADDLESEG_CALCULATE_AREA,
    LOADER_SHUTDOWN, NUMPY_IN1D, CONST_CONTIGUOUS, GATHER_AXIS_GRADIENT, AMP_STATE_API,
    PLACE_KIND, JIT_SAVE_FORWARD, PARAMETERLESS_PROGRAM, CPU_TENSOR_STREAM, FREE_GPU_MEMORY,
    BATCHNORM_TRACKING_NOTICE, BUILDER_YAML, PIR_OUT_TENSOR_LINE, ORT_INITIALIZER_LINES,
    ELASTIC_OWN_FAILURE, ONEDNN_INT_SCALE, OPTIMIZER_SCHEDULER, SYNC_BATCHNORM_BACK, CUSTOM_OP_CALL,
    TO_STATIC_GLOBALS, MKL_ON_AMD)
