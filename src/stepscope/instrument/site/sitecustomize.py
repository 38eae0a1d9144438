"""Put on PYTHONPATH by `stepscope run`: instruments every Python process of the measured command.

Python imports only the first sitecustomize on sys.path, so this one then runs the one it shadows, if any.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _run_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    others = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        # `import sitecustomize` and sys.modules must give the user's module, with its attributes, not this one
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


try:
    from stepscope.instrument.bootstrap import activate

    activate()
except Exception as error:  # never stop the user's program from starting
    print(f"stepscope: instrumentation is off in this process ({type(error).__name__}: {error}).", file=sys.stderr)
_run_shadowed()
