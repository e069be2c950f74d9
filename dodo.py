"""ipubuild's tasks for this tree: `doit build:vit_fp8`, `doit list --all`, `doit inspect:vit_fp8`."""
from ipubuild.tasks import load

globals().update(load(__file__))
