"""The engine: a content-addressed build engine that knows no tiles, graphs or doit.

Owns phases and their registry, action keys and signatures (``engine``), the store (``store``:
sqlite/diskcache, verified reads, the shared tier reached by name), code fingerprints
(``fingerprint``), atomic files and stat memos (``files``), the canonical encoding
(``canonical``), the build log (``log``), one-line user errors (``errors``), where independent
work runs (``executors``: here, or a cluster backend reached by name) and ``registry`` (the one
table of modules the engine reaches by name, never by import).

May import: the standard library, diskcache; ``ipubuild.hookspecs``. Nothing else of ipubuild.
"""


def __getattr__(name):   # the names of the module this folder replaced (ipubuild/engine.py), for a release
    from .. import moved_attribute
    return moved_attribute(__name__, name)
