"""Which way the imports point: docs/design.md's layering table, rule for rule, and light imports.

The static checks read every ``import psanet...`` / ``from psanet... import``
/ ``from . import`` statement in psanet/**/*.py, at module level and inside
functions, against the table that docs/design.md holds; the others import in a
fresh interpreter and look at ``sys.modules``.
"""
import ast
import json
import os
import re
import sys

import pytest

from conftest import ROOT, run_process

PACKAGE = os.path.join(ROOT, 'psanet')
DESIGN = os.path.join(ROOT, 'docs', 'design.md')
# What importing the deploy package, the op package or setup.py must not load: the training stack.
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


def _import_nodes(tree):
    """``(node, inside_a_function)`` for every import statement of a module's tree."""
    def walk(node, inside):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, inside
            yield from walk(child, inside or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    yield from walk(tree, False)


def _imports(name, path, modules, inside=None):
    """The psanet modules ``name`` imports: anywhere in its file (``inside`` None), at module
    level (False) or inside a function only (True)."""
    is_package = os.path.basename(path) == '__init__.py'
    package = name if is_package else name.rpartition('.')[0]
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = set()
    for node, in_function in _import_nodes(tree):
        if inside is not None and in_function != inside:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = package.split('.')
                base = base[:len(base) - node.level + 1]
                source = '.'.join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            # `from a import b`: the module a.b when there is one, else a.
            targets = [f'{source}.{alias.name}' if f'{source}.{alias.name}' in modules
                       else source for alias in node.names]
        found.update(t for t in targets if t == 'psanet' or t.startswith('psanet.'))
    found.discard(name)
    return found


@pytest.fixture(scope='module')
def graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def read_layering(path=DESIGN):
    """docs/design.md's layering table: ``{part: (module-level imports, function-only)}``."""
    with open(path, encoding='utf-8') as f:
        text = f.read()
    begin, end = '<!-- layering: read by tests/test_imports.py -->', '<!-- end of layering -->'
    assert begin in text and end in text, f'{path} has lost its layering table'
    rows = [line for line in text.split(begin)[1].split(end)[0].splitlines()
            if line.startswith('| `')]
    layering = {}
    for row in rows:
        cells = [cell.strip() for cell in row.strip().strip('|').split('|')]
        assert len(cells) == 3, row
        part = re.match(r'`([\w.]+)`', cells[0]).group(1)
        names = [set(re.findall(r'`([\w.]+)`', cell)) for cell in cells[1:]]
        layering[part] = tuple(names)
    return layering


@pytest.fixture(scope='module')
def layering():
    return read_layering()


def _part_of(module, parts):
    """The longest part name that is ``module`` or a package above it."""
    owners = [p for p in parts if module == p or module.startswith(p + '.')]
    return max(owners, key=len) if owners else None


def _allowed(target, names):
    return any(target == n or target.startswith(n + '.') for n in names)


def _layering_breaks(modules, layering, inside):
    """``module -> target`` imports the table does not allow at that level."""
    broken = []
    for name, path in sorted(modules.items()):
        part = _part_of(name, layering)
        module_level, in_function = layering[part]
        allowed = module_level | in_function if inside else module_level
        for target in sorted(_imports(name, path, modules, inside=inside)):
            if _part_of(target, layering) != part and not _allowed(target, allowed):
                broken.append(f'{name} -> {target}')
    return broken


def test_every_module_has_a_row_in_the_layering_table(layering):
    modules = _modules()
    assert not [name for name in modules if _part_of(name, layering) is None]
    named = set().union(*(a | b for a, b in layering.values()))
    assert not [n for n in named | set(layering) if not any(
        m == n or m.startswith(n + '.') for m in modules)], 'a row names no module'


def test_module_level_imports_follow_the_layering_table(layering):
    assert not _layering_breaks(_modules(), layering, inside=False)


def test_imports_inside_functions_follow_the_layering_table(layering):
    assert not _layering_breaks(_modules(), layering, inside=True)


def test_the_layering_table_runs_one_way(layering):
    # A part imports only parts above it in the table: no cycle can form through the rows.
    order = list(layering)
    for part, (module_level, in_function) in layering.items():
        for name in module_level | in_function:
            below = _part_of(name, layering)
            assert order.index(below) < order.index(part), f'{part} -> {name}'


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


def test_no_two_modules_share_a_file_name():
    names = {}
    for name, path in _modules().items():
        if os.path.basename(path) != '__init__.py':
            names.setdefault(os.path.basename(path), []).append(name)
    assert not {k: v for k, v in names.items() if len(v) > 1}


def test_the_data_tools_import_no_paddle():
    for name, path in _modules().items():
        if name.startswith('psanet.data'):
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            for node, _ in _import_nodes(tree):
                sources = ([a.name for a in node.names] if isinstance(node, ast.Import)
                           else [node.module or ''])
                assert not [s for s in sources if s.split('.')[0] in ('paddle', 'paddleseg')], \
                    (name, sources)


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
    # The script's imports, as `python deploy/python/infer.py` runs them, without running it:
    # its module, then what its main() imports once the flags are parsed.
    loaded = _loaded_after(
        'import importlib.util, re\n'
        "spec = importlib.util.spec_from_file_location('infer_script', "
        "'deploy/python/infer.py')\n"
        'spec.loader.exec_module(importlib.util.module_from_spec(spec))\n'
        "main = open('deploy/python/infer.py').read().split('def main(')[1]\n"
        "for line in re.findall(r'^ +(from psanet[.\\w]* import .*)$', main, re.M):\n"
        '    exec(line.strip())')
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


def test_the_save_dir_lock_and_the_checkpoints_load_no_paddleseg():
    # A run's folder is locked and its checkpoints listed before any config is built.
    loaded = _loaded_after('import psanet.core.run_folder')
    assert 'psanet.core.run_folder' in loaded and 'psanet.core.checkpoint' in loaded
    assert not [m for m in loaded if m.startswith(('paddleseg', 'psanet.core.config',
                                                   'psanet.models'))], loaded


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
