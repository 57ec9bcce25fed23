"""Shared test setup: the repository root on sys.path and the paths every test file needs.

Test modules import these names (``from conftest import ROOT``) instead of
working the root out again; fixtures shared by several files live here too.
"""
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MINI_CONFIG, = glob.glob(os.path.join(ROOT, 'configs', 'psanet', '*mini*.yml'))
