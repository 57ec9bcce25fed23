"""Which way the imports point: a one-way module graph, light leaves, a runtime without the engine.

The static checks read every ``import psanet...`` / ``from psanet... import``
/ ``from . import`` statement in psanet/**/*.py (module level or inside a
function alike); the others import in a fresh interpreter and look at
``sys.modules``.
"""
import ast
import json
import os
import sys

import pytest

from conftest import ROOT, run_process

PACKAGE = os.path.join(ROOT, 'psanet')
# Leaves: what every layer may import. errors and log import nothing of ours;
# contract and interrupts raise errors, cli runs commands with errors, log and interrupts.
LEAVES = {
    'psanet.errors': set(),
    'psanet.compat': set(),
    'psanet.log': set(),
    'psanet.contract': {'psanet.errors'},
    'psanet.interrupts': {'psanet.errors'},
    # cli also names the op loader's error: an op cache that cannot be written is one line.
    'psanet.cli': {'psanet.compat', 'psanet.errors', 'psanet.log', 'psanet.interrupts',
                   'psanet.ops.library'},
}
# What the deploy runtime may import besides itself.
RUNTIME_MAY_IMPORT = {'psanet.compat', 'psanet.contract', 'psanet.errors', 'psanet.interrupts',
                      'psanet.log', 'psanet.ops.library'}
# What importing the runtime, the op package or setup.py must not load: the training stack.
ENGINE_PREFIXES = ('paddleseg', 'psanet.models', 'psanet.core', 'psanet.data', 'psanet.export')


def _module_name(path):
    parts = os.path.relpath(path, ROOT)[:-len('.py')].split(os.sep)
    return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def _modules():
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith('.py'):
                path = os.path.join(folder, name)
                found[_module_name(path)] = path
    return found


def _imports(name, path, modules):
    """The psanet modules ``name`` imports, anywhere in its file."""
    is_package = os.path.basename(path) == '__init__.py'
    package = name if is_package else name.rpartition('.')[0]
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split('.')
                base = base[:len(base) - node.level + 1]
                source = '.'.join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            # `from a import b`: the module a.b when there is one, else a.
            targets = [f'{source}.{alias.name}' if f'{source}.{alias.name}' in modules
                       else source for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t == 'psanet' or t.startswith('psanet.'))
    found.discard(name)
    return found


@pytest.fixture(scope='module')
def graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_package_has_no_import_cycle(graph):
    state = {}

    def visit(name, trail):
        if state.get(name) == 'done':
            return
        assert state.get(name) != 'open', ' -> '.join(trail + [name])
        state[name] = 'open'
        for target in sorted(graph.get(name, ())):
            visit(target, trail + [name])
        state[name] = 'done'

    for name in sorted(graph):
        visit(name, [])


@pytest.mark.parametrize('leaf', sorted(LEAVES))
def test_the_leaves_import_only_the_leaves_below_them(graph, leaf):
    assert graph[leaf] <= LEAVES[leaf], graph[leaf] - LEAVES[leaf]


def test_the_runtime_imports_neither_the_engine_nor_the_models_nor_export(graph):
    for name, targets in graph.items():
        if name.startswith('psanet.deploy'):
            outside = {t for t in targets if not t.startswith('psanet.deploy')}
            assert outside <= RUNTIME_MAY_IMPORT, (name, outside - RUNTIME_MAY_IMPORT)


# Export is the top of the build side: only the Python API's from_config, an entry point
# like export.py, reaches it (inside the method, so that the API loads light).
EXPORT_USERS = {'psanet.api'}


def test_nothing_but_the_api_imports_export(graph):
    assert not [name for name, targets in graph.items()
                if 'psanet.export' in targets and name not in EXPORT_USERS]


# The server sits on top, beside the API: nothing of the package imports it.
def test_nothing_imports_the_server(graph):
    assert not [name for name, targets in graph.items() if not name.startswith('psanet.serve')
                and any(t.startswith('psanet.serve') for t in targets)]


def test_ops_import_nothing_of_ours_and_models_only_ops_and_errors(graph):
    for name, targets in graph.items():
        if name.startswith('psanet.ops'):
            assert all(t.startswith('psanet.ops') for t in targets), (name, targets)
        if name.startswith('psanet.models'):
            assert all(t.startswith(('psanet.models', 'psanet.ops')) or
                       t in ('psanet.errors', 'psanet.compat') for t in targets), (name, targets)


def _loaded_after(code):
    """The psanet modules in sys.modules after running ``code`` in a fresh interpreter."""
    probe = code + ('\nimport json, sys\n'
                    'print(json.dumps(sorted(m for m in sys.modules '
                    "if m.split('.')[0] in ('psanet', 'paddleseg'))))")
    result = run_process([sys.executable, '-c', probe], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def _assert_no_training_stack(loaded):
    assert not [m for m in loaded if m.startswith(ENGINE_PREFIXES)], loaded


def test_importing_the_runtime_loads_no_engine_data_or_export_code():
    # All of them in one interpreter: what none of them loads, the union does not load.
    runtime = sorted(name for name in _modules() if name.startswith('psanet.deploy'))
    loaded = _loaded_after('\n'.join(f'import {name}' for name in runtime))
    assert set(runtime) <= set(loaded)
    _assert_no_training_stack(loaded)


def test_the_deploy_command_line_loads_no_engine_data_or_export_code():
    # The script's imports, as `python deploy/python/infer.py` runs them, without running it.
    loaded = _loaded_after(
        'import importlib.util\n'
        "spec = importlib.util.spec_from_file_location('infer_script', "
        "'deploy/python/infer.py')\n"
        'spec.loader.exec_module(importlib.util.module_from_spec(spec))')
    assert 'psanet.deploy.infer_images' in loaded
    _assert_no_training_stack(loaded)


def test_importing_the_op_package_loads_no_training_stack():
    loaded = _loaded_after('import psanet.ops\nimport psanet.ops.build')
    assert 'psanet.ops.library' in loaded
    _assert_no_training_stack(loaded)


@pytest.mark.parametrize('command', [['--name'], ['-q', 'build_py']])
def test_setup_py_loads_no_training_stack(command, tmp_path):
    # setup.py run in this interpreter, so that its modules can be listed; build_py imports
    # the op's build module (its compiler stubbed: the modules are the point here).
    argv = ['setup.py'] + command + (['--build-lib', str(tmp_path)] if 'build_py' in command
                                     else [])
    loaded = _loaded_after(
        'import contextlib, io, runpy, sys\n'
        'import psanet.ops.build\n'
        'psanet.ops.build.compile_library = lambda target, **kwargs: open(target, "w").close()\n'
        f'sys.argv = {argv!r}\n'
        'with contextlib.redirect_stdout(io.StringIO()) as out:\n'
        '    try:\n'
        "        runpy.run_path('setup.py', run_name='__main__')\n"
        '    except SystemExit as stop:\n'
        '        assert not stop.code, stop.code\n'
        "assert 'build_py' in sys.argv or out.getvalue().strip() == 'psanet', out.getvalue()")
    assert 'psanet.ops.build' in loaded
    _assert_no_training_stack(loaded)
    if 'build_py' in command:
        assert (tmp_path / 'psanet' / 'ops' / 'psa_mask_op.so').is_file()


def test_importing_the_package_loads_nothing_else():
    assert _loaded_after('import psanet') == ['psanet']


def test_importing_the_server_package_loads_nothing_else():
    assert _loaded_after('import psanet.serve') == ['psanet', 'psanet.serve']


def test_the_python_api_loads_the_runtime_only():
    # psanet.Segmenter is looked up lazily; Segmenter.from_config loads the build side
    # when it is called, not when the API is imported.
    loaded = _loaded_after('from psanet import Segmenter\nassert Segmenter.from_config\n'
                           'assert Segmenter.__module__ == "psanet.api"')
    assert 'psanet.deploy.pipeline' in loaded
    _assert_no_training_stack(loaded)


def test_importing_the_models_registers_psanet_with_paddleseg():
    code = ('import psanet.models\n'
            'from paddleseg.cvlibs import manager\n'
            "assert manager.MODELS['PSANet'] is psanet.models.PSANet")
    assert 'psanet.models.psanet' in _loaded_after(code)


def test_importing_the_engine_package_loads_none_of_its_modules():
    loaded = _loaded_after('import psanet.core')
    assert not [m for m in loaded if m.startswith('psanet.core.')], loaded


def test_no_function_outside_the_models_takes_more_than_eight_parameters():
    """A job's options travel as one object (psanet.core.options), not as argument relays;
    model constructors keep PaddleSeg's one keyword per YAML key."""
    crowded = []
    for name, path in sorted(_modules().items()):
        if name.startswith('psanet.models'):
            continue
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
                names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
                names = [n for n in names if n not in ('self', 'cls')]
                if len(names) > 8:
                    crowded.append(f'{name}.{node.name} ({len(names)})')
    assert not crowded, crowded


# A module a reader takes in as one page: split by subject past this.
MODULE_LINE_LIMIT = 500


def test_no_module_of_the_package_is_over_500_lines():
    long = []
    for name, path in sorted(_modules().items()):
        with open(path, encoding='utf-8') as f:
            count = sum(1 for _ in f)
        if count > MODULE_LINE_LIMIT:
            long.append(f'{name} ({count} lines)')
    assert not long, f'split by subject: {long}'
