"""The built-in cache backend: Bazel's HTTP cache protocol for ``http://`` and ``https://``
remote caches (``ipubuild.remote.http``). This module stays tiny: the client is imported only
when a build is pointed at a remote."""
from .. import hookimpl


def _http_cache(url: str):
    from ..remote.http import HttpCache
    return HttpCache(url)


@hookimpl
def ipubuild_cache_backends():
    return {"http": _http_cache, "https": _http_cache}
