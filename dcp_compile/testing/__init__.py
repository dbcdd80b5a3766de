"""Testing tools that ship with the package (the emulated Ascend device); never imported on a
machine with a real device stack."""
