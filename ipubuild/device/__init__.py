"""The device: what runs a compiled program and judges it.

Owns the package format (``package``), the device interface and its runs (``device``), the
numerical comparison (``compare``) and the verdict (``verdict``).

May import: ``ipubuild.engine``, ``ipubuild.plugins``/``hookspecs``, ``ipubuild.graph``,
``ipubuild.compiler``.
"""


def __getattr__(name):   # the names of the module this folder replaced (ipubuild/device.py), for a release
    from .. import moved_attribute
    return moved_attribute(__name__, name)
