"""The user interface: what a person sees of a build.

Owns the console reporter (``console``), the live progress line (``progress``), the build
report (``report``) and its HTML page (``report_page``).

May import: ``ipubuild.engine``, ``ipubuild.graph``; doit's reporter; rich (only when drawing).
"""
