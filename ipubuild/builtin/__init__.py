"""ipubuild's own features, written as plugins against ``ipubuild.hookspecs``."""
