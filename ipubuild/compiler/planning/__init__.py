"""The compiler proper: from the FP8 graph and a layout to tile programs, memory and exchanges."""
