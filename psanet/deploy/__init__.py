"""Deployment of an exported PSANet: deploy.yaml, predictor creation, pre/post-processing."""
from .check import compare_with_dygraph
from .config import DeployConfig, DeployError, graph_holds_custom_op
from .predictor import OnnxRunner, PaddleRunner, create_predictor, load_custom_op
from .processing import postprocess, preprocess, restore_label_map
from .timing import StageTimer, format_table

__all__ = ['DeployConfig', 'DeployError', 'graph_holds_custom_op', 'create_predictor',
           'load_custom_op', 'PaddleRunner', 'OnnxRunner', 'preprocess', 'postprocess',
           'restore_label_map', 'StageTimer', 'format_table', 'compare_with_dygraph']
