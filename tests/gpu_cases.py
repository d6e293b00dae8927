"""The GPU suites' former helper module: the module object of :mod:`tests.util` under this name (so a
monkeypatch of ``gpu_cases.OPTIONS`` reaches ``util.build``)."""

import sys

from tests import util

sys.modules[__name__] = util
