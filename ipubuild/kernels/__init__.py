"""The kernels: C sources (``*.c``, ``ipu_kernel.h``), their cycle estimators (``*_cycles.py``,
``cycles``) and the cycle counter (``counter/``) — where kernel developers edit them. Compiling
them is the compiler's (``ipubuild.compiler.kernels``).

May import: ``ipubuild.graph`` (operators) and ``ipubuild.engine``.
"""


def __getattr__(name):   # the names of the module this folder replaced (ipubuild/kernels/__init__.py), for a release
    from .. import moved_attribute
    return moved_attribute(__name__, name)
